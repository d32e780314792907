"""One step of the speculative loop: the scheduler's DraftRequest and VerifyRequest batches,
the drafter's and the verifier's answers, and what rows carry (proposals, target features)
(docs/PROTOCOL.md#scheduler-and-drafter, #scheduler-and-verifier).

A batch holds each request at most once (`check_rows`); draft tokens and their proposal agree
(`check_drafts`), and a tree of them is well formed (`check_tree`, `tree_depths`); no row accepts
more drafts than it had (`check_accepted`).
"""

from typing import Any, Literal

import numpy as np
from pydantic import ConfigDict, Field, model_validator

from schemas.arrays import ROOT_PARENT, IdMatrix, ParentIndices, ProbMatrix, TokenIds, empty_ids
from schemas.generation import LogprobOptions, RowSampling
from schemas.bus.protocol import (MAX_BATCH_ROWS, MAX_FEATURE_BLOCK_BYTES, MAX_FEATURE_SIZE, MAX_SPECULATIVE_TOKENS,
                              MAX_TREE_NODES)
from schemas.bus.wire import Count, Deadline, Error, InstanceId, Message, RequestId, WireModel, field_error


class Proposal(WireModel):
    """The distributions the draft tokens were drawn from (docs/PROTOCOL.md#proposal), n = #drafts
    (the nodes of a tree: row i is node i's law given the path from the root to its parent).

    point_mass: no arrays; p_i is one-hot at the draft token (greedy / top-1 drafts).
    sparse: ids [n, S] (TARGET vocabulary ids, -1 = padding with prob 0) and probs [n, S].
    dense: probs [n, V_draft] over the DRAFT vocabulary (the verifier maps it with d2t),
           draft_vocab_size = V_draft.
    """

    kind: Literal["point_mass", "sparse", "dense"] = "point_mass"
    ids: IdMatrix | None = None
    probs: ProbMatrix | None = None
    draft_vocab_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _arrays_match_kind(self) -> "Proposal":
        if self.kind == "point_mass":
            for name in ("ids", "probs", "draft_vocab_size"):
                if getattr(self, name) is not None:
                    raise field_error(name, f"a point_mass proposal carries no {name}")
        elif self.probs is None:
            raise field_error("probs", f"a {self.kind} proposal needs probs")
        elif self.kind == "sparse":
            if self.ids is None or self.ids.shape != self.probs.shape:
                shape = None if self.ids is None else list(self.ids.shape)
                raise field_error("ids", f"a sparse proposal needs ids shaped like probs {list(self.probs.shape)}, "
                                         f"got {shape}")
            if self.draft_vocab_size is not None:
                raise field_error("draft_vocab_size", "only a dense proposal has a draft vocabulary size")
        else:
            if self.ids is not None:
                raise field_error("ids", "a dense proposal carries no ids")
            if self.draft_vocab_size != self.probs.shape[1]:
                raise field_error("draft_vocab_size",
                                  f"draft_vocab_size {self.draft_vocab_size} != probs width {self.probs.shape[1]}")
        return self


def check_drafts(draft_token_ids: np.ndarray, proposal: Proposal, parents: np.ndarray | None = None) -> None:
    """Drafts and proposal must agree: one proposal row per draft token, and a sparse
    support must give each draft token a non-zero probability (else rejection divides by 0).
    A chain (parents None) holds at most MAX_SPECULATIVE_TOKENS drafts; a tree, check_tree."""
    num_draft = len(draft_token_ids)
    if parents is not None:
        check_tree(draft_token_ids, parents, proposal.kind)
    elif num_draft > MAX_SPECULATIVE_TOKENS:
        raise field_error("draft_token_ids", f"at most {MAX_SPECULATIVE_TOKENS} draft tokens, got {num_draft}")
    if proposal.probs is not None and proposal.probs.shape[0] != num_draft:
        raise field_error("proposal.probs", f"{proposal.probs.shape[0]} proposal rows for {num_draft} draft tokens")
    if proposal.kind == "sparse":
        in_support = ((proposal.ids == draft_token_ids[:, None]) & (proposal.probs > 0)).any(axis=1)
        if not in_support.all():
            position = int(np.argmin(in_support))
            raise field_error("proposal.ids", f"draft token at position {position} has no probability in the support")


def chain_parents(num_draft: int) -> np.ndarray:
    """The parents of a chain of num_draft drafts as a tree: [ROOT_PARENT, 0, 1, ..., num_draft - 2]."""
    return np.arange(ROOT_PARENT, num_draft - 1, dtype=np.int32)


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Each node's depth, int32 [n], from its parents [n] (nodes in depth-first preorder): 1 for a
    child of the root (ROOT_PARENT), d + 1 for a child of a node at depth d; a chain's are 1..n.

    Refuses (field_error naming `parents`) a parent that does not come before its node, and an
    order that is not depth-first preorder: node i's parent must be node i - 1, one of node i - 1's
    ancestors, or the root.
    """
    depths = np.zeros(len(parents), np.int32)
    path: list[int] = []  # node i - 1 and its ancestors, the root's child first
    for node, parent in enumerate(parents.tolist()):
        if parent >= node:
            raise field_error("parents", f"node {node}'s parent {parent} does not come before it")
        while path and path[-1] != parent:
            path.pop()
        if parent != ROOT_PARENT and not path:
            raise field_error("parents", f"node {node}'s parent {parent} is neither node {node - 1} nor one of its "
                                         f"ancestors: nodes go in depth-first preorder")
        path.append(node)
        depths[node] = len(path)
    return depths


def check_tree(draft_token_ids: np.ndarray, parents: np.ndarray, kind: str) -> None:
    """A tree of draft tokens (docs/PROTOCOL.md#tree-drafts): at most MAX_TREE_NODES nodes, one
    parent each, in depth-first preorder (tree_depths), no path deeper than MAX_SPECULATIVE_TOKENS,
    and, under point-mass laws, no two siblings with the same token: once the first is rejected
    the second is too (the target's draw is not it, or the residual gives it no mass)."""
    num_nodes = len(draft_token_ids)
    if num_nodes > MAX_TREE_NODES:
        raise field_error("draft_token_ids", f"at most {MAX_TREE_NODES} nodes in a tree of draft tokens, "
                                             f"got {num_nodes}")
    if len(parents) != num_nodes:
        raise field_error("parents", f"{len(parents)} parents for {num_nodes} draft tokens")
    depths = tree_depths(parents)
    if num_nodes and depths.max() > MAX_SPECULATIVE_TOKENS:
        node = int(np.argmax(depths > MAX_SPECULATIVE_TOKENS))
        raise field_error("parents", f"node {node} is at depth {depths[node]}, deeper than "
                                     f"{MAX_SPECULATIVE_TOKENS} draft tokens")
    if kind == "point_mass":
        first: dict[tuple[int, int], int] = {}  # (parent, token) -> the first node with them
        for node, key in enumerate(zip(parents.tolist(), draft_token_ids.tolist())):
            if key in first:
                raise field_error("draft_token_ids", f"nodes {first[key]} and {node}, siblings, both propose token "
                                                     f"{key[1]} under point-mass laws")
            first[key] = node


def check_accepted(num_draft: int, num_accepted: int) -> None:
    if num_accepted > num_draft:
        raise field_error("num_accepted", f"{num_accepted} accepted of {num_draft} drafts")


def check_rows(rows: list[Any]) -> None:
    """Within one batch each request appears once, and (in requests; results carry no row
    index) row indices are distinct."""
    seen_ids: set[str] = set()
    seen_rows: set[int] = set()
    for index, row in enumerate(rows):
        if row.request_id in seen_ids:
            raise field_error(f"rows[{index}].request_id", f"request {row.request_id} appears twice in the batch")
        seen_ids.add(row.request_id)
        if hasattr(row, "row"):
            if row.row in seen_rows:
                raise field_error(f"rows[{index}].row", f"row index {row.row} appears twice in the batch")
            seen_rows.add(row.row)


class Batch(Message):
    """One message per batch step: `rows` (declared by each subclass) hold each request at most once."""

    batch_id: Count  # unique and increasing per scheduler

    @model_validator(mode="after")
    def _unique_rows(self) -> "Batch":
        check_rows(self.rows)
        return self


class DraftTokens(WireModel):
    """Draft tokens, as TARGET vocabulary ids (the drafter maps them with d2t), and the
    proposal they were drawn from; the two must agree (check_drafts). They form a chain, or
    with `parents` a tree (docs/PROTOCOL.md#tree-drafts); either way a row's count of draft
    tokens is len(draft_token_ids), every node of a tree."""

    draft_token_ids: TokenIds = Field(default_factory=empty_ids, description=(
        "the draft tokens: a chain's in order, or a tree's nodes in depth-first preorder; at most "
        "MAX_SPECULATIVE_TOKENS in a chain, MAX_TREE_NODES in a tree"))
    parents: ParentIndices | None = Field(None, description=(
        "for a tree, node i's parent: the index of an earlier node, or -1 (ROOT_PARENT) for a child of the row's "
        "last committed token; as long as draft_token_ids. None: a chain, the same as [-1, 0, 1, ...]"))
    proposal: Proposal = Field(default_factory=Proposal)

    @model_validator(mode="after")
    def _drafts_match_proposal(self) -> "DraftTokens":
        check_drafts(self.draft_token_ids, self.proposal, self.parents)
        return self


class FeatureBlock(WireModel):
    """The target's features at consecutive history positions (docs/PROTOCOL.md#feature-level-drafts).

    start: the history position of row 0. shape: [n, E], n >= 1 positions of E values, E the
    target's hidden size, 2 x n x E at most MAX_FEATURE_BLOCK_BYTES. data: n x E little-endian
    bfloat16 values, row-major: row i is the final-normed hidden state at position start + i (what
    the target's lm_head reads), rounded to bf16.
    """

    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64")

    start: Count
    shape: list[int] = Field(min_length=2, max_length=2)
    dtype: Literal["bfloat16"] = "bfloat16"
    data: bytes = Field(strict=True)

    @model_validator(mode="after")
    def _sizes_agree(self) -> "FeatureBlock":
        n, e = self.shape
        if n < 1 or not 1 <= e <= MAX_FEATURE_SIZE:
            raise field_error("shape", f"shape {self.shape}: a block holds n >= 1 positions of 1 <= E <= "
                                       f"{MAX_FEATURE_SIZE} values")
        if 2 * n * e > MAX_FEATURE_BLOCK_BYTES:
            raise field_error("shape", f"shape {self.shape} is {2 * n * e} bytes of bfloat16, over the "
                                       f"{MAX_FEATURE_BLOCK_BYTES} bytes of a block")
        if len(self.data) != 2 * n * e:
            raise field_error("data", f"{len(self.data)} bytes do not hold a bfloat16 matrix of shape "
                                      f"{self.shape} ({2 * n * e} bytes)")
        return self

    @property
    def end(self) -> int:
        """The history position after its last row."""
        return self.start + self.shape[0]


class DraftRow(WireModel):
    """One request in a DraftRequest.

    cached_len: committed tokens the scheduler expects the drafter to hold BEFORE appending
    new_token_ids (0 = start from scratch: new_token_ids is then the whole history).
    A drafter holding something else answers need_resync instead of guessing.
    prompt_len: history positions before it are the prompt, the rest the output, whose tokens
    the draft's own presence and frequency penalties count.
    features: for an eagle drafter, the target's features the scheduler received since it last
    gave this drafter some, joined (docs/PROTOCOL.md#feature-level-drafts); None for the others.
    """

    request_id: RequestId
    row: Count
    step: Count
    cached_len: Count
    new_token_ids: TokenIds = Field(default_factory=empty_ids)
    num_draft: int = Field(ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "the most drafts of a chain; with max_nodes, the deepest path of a tree"))
    max_nodes: int = Field(0, ge=0, le=MAX_TREE_NODES, description=(
        "0: a chain of at most num_draft drafts; else the drafter may answer a tree of at most max_nodes nodes, no "
        "path deeper than num_draft (docs/PROTOCOL.md#tree-drafts); a chain is always a valid answer. At least "
        "num_draft, and num_draft at least 1, when not 0"))
    draft_mode: Literal["greedy", "sample"] = "greedy"
    sampling: RowSampling = Field(default_factory=RowSampling)
    prompt_len: Count = 0
    features: FeatureBlock | None = None
    cache_salt: str | None = Field(None, max_length=256, description=(
        "whose prefix cache a new slot's history may be found in and kept for, as VerifyRow.cache_salt "
        "(docs/PROTOCOL.md#prefix-caching); None: none, every token is fed"))

    @model_validator(mode="after")
    def _a_tree_holds_its_depth(self) -> "DraftRow":
        if self.max_nodes and not 1 <= self.num_draft <= self.max_nodes:
            raise field_error("max_nodes", f"a tree of at most {self.max_nodes} nodes needs a depth (num_draft) of 1 "
                                           f"to {self.max_nodes}, got {self.num_draft}")
        return self


class DraftRequest(Batch):
    """release: requests whose slots the drafter must free (finished, cancelled, moved away);
    a batch may carry only releases and no rows."""

    type: Literal["draft_request"] = "draft_request"
    scheduler_id: InstanceId
    deadline: Deadline
    rows: list[DraftRow] = Field(max_length=MAX_BATCH_ROWS)
    release: list[RequestId] = Field(default_factory=list, max_length=MAX_BATCH_ROWS)


class DraftResult(DraftTokens):
    request_id: RequestId
    need_resync: bool = False


class DraftResponse(Batch):
    type: Literal["draft_response"] = "draft_response"
    drafter_id: InstanceId
    rows: list[DraftResult] = Field(max_length=MAX_BATCH_ROWS)


class VerifyRow(DraftTokens):
    """One request in a VerifyRequest.

    The verifier appends new_token_ids (committed, unseen by it) after cached_len tokens, then
    draft_token_ids, and verifies the drafts. prompt_len says which positions are prompt (for
    prompt logprobs). postprocessor_id: where the side channel goes (None = no side channel).
    is_retry: the same (request_id, step) was sent before; answer it again, never append twice.
    emit: False for a prefill chunk that stops short of the end of the history: append only,
    sample nothing. Prompt logprobs are accumulated over chunks and published in the side
    record of the row that completes the prompt.
    """

    request_id: RequestId
    row: Count
    step: Count
    cached_len: Count
    new_token_ids: TokenIds = Field(default_factory=empty_ids)
    sampling: RowSampling = Field(default_factory=RowSampling)
    logprobs: LogprobOptions = Field(default_factory=LogprobOptions)
    postprocessor_id: InstanceId | None = None
    prompt_len: Count
    is_retry: bool = False
    emit: bool = True
    max_forced: int = Field(0, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "for a row with structured_outputs: how many tokens the grammar forces after the drafts the verifier may "
        "append as point-mass drafts (docs/PROTOCOL.md#structured-outputs); 0 = none, always for a tree of drafts"))
    features_from: Count | None = Field(None, description=(
        "the first history position whose target features the result carries, up to the last position the "
        "verifier holds after the step (docs/PROTOCOL.md#feature-level-drafts); None: no features"))
    cache_salt: str | None = Field(None, max_length=256, description=(
        "whose prefix cache the request's history may be found in and kept for (the client user, or a group "
        "the operator lets share one, docs/PROTOCOL.md#prefix-caching); None: none, every token is computed"))

    @model_validator(mode="after")
    def _forced_after_a_chain(self) -> "VerifyRow":
        if self.parents is not None and self.max_forced:
            raise field_error("max_forced", "forced tokens follow a chain of drafts, not a tree")
        return self


class VerifyRequest(Batch):
    """release: requests whose slots the verifier must free (finished, cancelled, moved away);
    a batch may carry only releases and no rows."""

    type: Literal["verify_request"] = "verify_request"
    scheduler_id: InstanceId
    deadline: Deadline
    rows: list[VerifyRow] = Field(max_length=MAX_BATCH_ROWS)
    release: list[RequestId] = Field(default_factory=list, max_length=MAX_BATCH_ROWS)


class VerifyResult(WireModel):
    """token_ids: the emitted tokens: num_accepted drafts then one recovered or bonus token,
    or none (a prefill chunk that emits nothing yet, need_resync, or error)."""

    request_id: RequestId
    step: Count
    token_ids: TokenIds = Field(default_factory=empty_ids)
    num_draft: int = Field(0, ge=0, le=MAX_TREE_NODES, description=(
        "the row's draft tokens, len(VerifyRow.draft_token_ids): every node of a tree"))
    num_forced: int = Field(0, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "forced tokens the verifier appended after the row's drafts it kept (VerifyRow.max_forced)"))
    num_replaced: int = Field(0, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "the row's last drafts the verifier did not verify: from the first one its grammar refuses, for a row whose "
        "drafts may give way to forced tokens (docs/PROTOCOL.md#structured-outputs)"))
    num_accepted: Count = 0
    need_resync: bool = False
    residual_fallback: bool = False  # the residual had zero mass; the target's own sample was emitted
    error: Error | None = None
    features: FeatureBlock | None = Field(None, description=(
        "the target's features of positions features_from up to the verifier's length after the step, at most "
        "MAX_FEATURE_BLOCK_BYTES of them; None when the row asked none or there are none"))
    cached_tokens: Count = Field(0, description=(
        "of the row's new tokens, how many the verifier copied from its prefix cache instead of computing"))

    @model_validator(mode="after")
    def _counts(self) -> "VerifyResult":
        if self.num_replaced > self.num_draft:
            raise field_error("num_replaced", f"{self.num_replaced} replaced of {self.num_draft} drafts")
        check_accepted(self.num_draft - self.num_replaced + self.num_forced, self.num_accepted)
        num_emitted = len(self.token_ids)
        if num_emitted != self.num_accepted + 1 and not (num_emitted == 0 and self.num_accepted == 0):
            raise field_error("token_ids", f"{num_emitted} tokens emitted for {self.num_accepted} accepted drafts")
        return self

    @property
    def drafts_accepted(self) -> int:
        """Of num_accepted, the drafter's drafts (the forced tokens come after those kept): what
        adaptive k and draft-method trials judge a drafter by."""
        return min(self.num_accepted, self.num_draft - self.num_replaced)


class VerifyResponse(Batch):
    type: Literal["verify_response"] = "verify_response"
    verifier_id: InstanceId
    rows: list[VerifyResult] = Field(max_length=MAX_BATCH_ROWS)
