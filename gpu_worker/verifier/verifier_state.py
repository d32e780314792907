"""The verifier's state: the target model and its KV cache (`Verifier`), what it remembers per
request (`VerifierSlot`), a row on its way through one step (`VerifyRowWork`) and an emitting
row's sampling output (`Verified`). gpu_worker/verifier/verifier_core.py's step fills them in.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from gpu_worker.batching.slots import SlotOwner
from gpu_worker.runtime.model import Model
from text.grammar import OutputMatcher
from gpu_worker.sampling.sampler import Penalties, ProcessedLogits, SamplingTensors
from schemas.commits import LogprobArrays, SideChannelRecord
from schemas.steps import VerifyResult, VerifyRow
from schemas.bus.wire import Error

SideRecord = tuple[str, SideChannelRecord]  # (postprocessor_id, record)


@dataclass
class VerifierSlot:
    """One request's cache slot and what the verifier remembers about it.

    token_ids: the ids the slot holds, position by position (4 bytes each, at most max_seq_len),
    from which the penalties count the output. step / result / record: the last answered step,
    for retries. prompt_logprobs covers prompt positions prompt_offset.. (the request asked for
    prompt logprobs and the prompt is not complete yet); prompt_logits (V,) are the logits at
    the last position fed, which give the logprob of the first token of the next chunk
    (position prompt_offset + n). features (capacity, E) bf16: row t is the target's feature at
    position t, valid below the slot's cache length (`store_features`). prefix_root: the key its
    prefix blocks chain from (None: its row has no cache_salt, or prefix caching is off) and
    block_keys those of its whole blocks so far (gpu_worker/batching/prefix_cache.py).
    """

    slot: int
    last_used: float  # time.monotonic()
    token_ids: array = field(default_factory=lambda: array("i"))
    step: int | None = None
    result: VerifyResult | None = None
    record: SideRecord | None = None
    prompt_logprobs: LogprobArrays | None = None
    prompt_offset: int = 1
    prompt_logits: torch.Tensor | None = None
    features: torch.Tensor | None = None
    grammar: OutputMatcher | None = None  # a row with structured_outputs (verifier_grammar.py)
    prefix_root: bytes | None = None
    block_keys: list[bytes] = field(default_factory=list)

    @property
    def prompt_end(self) -> int:
        """The first prompt position not covered yet."""
        return self.prompt_offset + (0 if self.prompt_logprobs is None else self.prompt_logprobs.n)


@dataclass(kw_only=True)
class Verifier(SlotOwner):
    model: Model
    prefill_chunk: int
    weights: str = "dense"  # the projections' format (a prefix key's part)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def kept(self, state: VerifierSlot) -> tuple[array, list[bytes], torch.Tensor | None]:
        """A released slot's entry: every id it holds, its block keys so far and its features."""
        return state.token_ids, state.block_keys, state.features


@dataclass
class VerifyRowWork:
    """A row going through the model this step.

    tokens (n_new + k,) int64 CPU: new_token_ids then draft tokens; tokens[t] lands at absolute
    position start + t. Logits are wanted at offsets [0, num_prompt) (prompt logprobs) and, for
    emitting rows, [num_new - 1, num_new + num_draft) (verify positions). A tree row
    (gpu_worker/verifier/verifier_trees.py) has one new token, the root, then its k nodes in
    depth-first preorder: node i sits at start + depth(i) and its verify logits are column
    i + 1 of the tree forward.
    """

    row: VerifyRow
    state: VerifierSlot
    tokens: torch.Tensor
    start: int
    num_new: int
    num_draft: int
    num_prompt: int
    params: SamplingTensors  # one row
    draft_probs: torch.Tensor | None  # (k, V), None for a point mass (or a greedy row)
    penalties: Penalties | None = None  # one row, over the history before the first verify position
    allowed: torch.Tensor | None = None  # (k+1, V) bool: a grammar's tokens at each verify position
    num_forced: int = 0  # the last num_forced of the k drafts are the grammar's forced tokens
    num_replaced: int = 0  # the row's drafts the grammar refused (and those after), not fed
    parents: torch.Tensor | None = None  # (k,) int64 CPU: a tree row's parents (None: a chain)
    hidden: torch.Tensor | None = None  # (k+1, E): a tree row's hidden states, kept for the accepted path
    fed: int = 0
    verify_logits: list[torch.Tensor] = field(default_factory=list)  # pieces of (m, V)
    prompt_pieces: list[LogprobArrays] = field(default_factory=list)  # consecutive prompt positions
    prompt_offset: int = 1  # the prompt position of prompt_pieces' first entry
    next_prompt_logits: torch.Tensor | None = None  # (V,): predict the next step's first token
    cached: int = 0  # tokens copied from the prefix cache, not computed (the first `fed`)
    error: Error | None = None

    @property
    def adjusted(self) -> bool:
        """Its logits are more than the model's: a grammar's mask, logit_bias or penalties (its
        raw logits are then kept apart)."""
        return self.penalties is not None or self.allowed is not None

    @property
    def wanted(self) -> list[int]:
        """Offsets whose logits this row needs, ascending (the two ranges may share one)."""
        verify = range(self.num_new - 1, self.num_new + self.num_draft) if self.row.emit else range(0)
        return sorted(set(range(self.num_prompt)) | set(verify))

    @property
    def completes_prompt(self) -> bool:
        return self.start < self.row.prompt_len <= self.start + self.num_new


@dataclass
class Verified:
    """Sampling output of one emitting row: emitted token ids, and what its logprobs need."""

    token_ids: torch.Tensor  # (n,) int64: accepted drafts, then the recovered or bonus token
    num_accepted: int
    residual_fallback: bool
    logits: torch.Tensor  # (n, V): the logits each emitted token was drawn from (penalised)
    raw_logits: torch.Tensor | None  # (n, V): the model's, for a row with logit_bias or penalties
    # [1, n, ...] slices of the sampler's output; None for a greedy batch, whose K (the argmax)
    # gather_logprobs recomputes from the logits as it does for prompt positions
    processed: ProcessedLogits | None
    accepted_nodes: list[int] | None = None  # a tree row's accepted path, its node indices from the root's child

