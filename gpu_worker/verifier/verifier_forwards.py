"""The verifier's forwards (step 3 of gpu_worker/verifier/verifier_core.py): every row's new tokens
then drafts through the target, in chunks of prefill_chunk tokens; chunks of similar length
share one padded forward (`pack_chunks`), and each forward hands its rows the logits they want
(`take_logits`: prompt logprobs computed at once, verify logits kept) and keeps their features.
"""

from __future__ import annotations

import bisect
from typing import Callable

import structlog
import torch

from gpu_worker.verifier.verifier_features import store_features
from gpu_worker.verifier.verifier_side_channel import logprob_arrays
from gpu_worker.verifier.verifier_state import Verifier, VerifyRowWork
from gpu_worker.runtime.model import forward
from schemas.bus.wire import Error

log = structlog.get_logger(__name__)

# Chunks share a padded forward while the padding stays under this many tokens plus a quarter
# of the real ones: a forward costs a fixed part (reading the weights) plus a part per token
# row, padded ones included, and past about their ratio a second forward costs less than the
# padding; so one decode row with a draft does not double a batch of rows without (see
# ops/bench/RESULTS.md, Figures behind gpu_worker's choices).
FREE_PADDING_TOKENS = 4


def pack_chunks(chunks: list[tuple[VerifyRowWork, int, int]]) -> list[list[tuple[VerifyRowWork, int, int]]]:
    """Group (work, begin, end) chunks into forwards: sorted by length, a chunk joins the
    current group while the group's padding stays within FREE_PADDING_TOKENS + real / 4."""
    groups: list[list[tuple[VerifyRowWork, int, int]]] = []
    real = 0
    for chunk in sorted(chunks, key=lambda c: c[2] - c[1]):
        length = chunk[2] - chunk[1]
        if groups:
            padded = (len(groups[-1]) + 1) * length
            if padded - (real + length) <= FREE_PADDING_TOKENS + (real + length) // 4:
                groups[-1].append(chunk)
                real += length
                continue
        groups.append([chunk])
        real = length
    return groups


def forward_group(verifier: Verifier, group: list[tuple[VerifyRowWork, int, int]]) -> None:
    """One padded forward of the chunks in group; hands each row the logits it wants."""
    device = verifier.model.embed.device
    T = max(end - begin for _, begin, end in group)
    token_ids = torch.zeros(len(group), T, dtype=torch.long)
    wanted = []
    for b, (work, begin, end) in enumerate(group):
        token_ids[b, :end - begin] = work.tokens[begin:end]
        wanted.append([o - begin for o in work.wanted if begin <= o < end])
    M = max(map(len, wanted))
    # rows wanting fewer positions repeat their last one (or 0); the extra logits are dropped
    logits_index = torch.tensor([w + [w[-1] if w else 0] * (M - len(w)) for w in wanted], dtype=torch.long)
    slots = torch.tensor([work.state.slot for work, _, _ in group], dtype=torch.long)
    num_new = torch.tensor([end - begin for _, begin, end in group], dtype=torch.long)
    logits, hidden = forward(verifier.model, verifier.cache, slots, token_ids.to(device), num_new, logits_index,
                             return_hidden=True)  # (B, M, V), (B, T, E)
    for b, (work, begin, end) in enumerate(group):
        offsets = [begin + o for o in wanted[b]]
        take_logits(verifier, work, offsets, logits[b, :len(offsets)])
        store_features(work.state, work.start + begin, hidden[b, :end - begin], verifier.cache)
        work.fed = end


def take_logits(verifier: Verifier, work: VerifyRowWork, offsets: list[int], logits: torch.Tensor) -> None:
    """Split a chunk's logits (m, V) at offsets into prompt logprobs (computed now, so a long
    prompt never holds all its logits) and verify logits (kept for sampling)."""
    # offsets ascend (VerifyRowWork.wanted): the prompt ones lead, the verify ones end the list, so
    # both are slices (views, no copy)
    num_prompt = bisect.bisect_left(offsets, work.num_prompt)
    if work.row.emit:
        work.verify_logits.append(logits[bisect.bisect_left(offsets, work.num_new - 1):])
    if not num_prompt:
        return
    prompt_logits = logits[:num_prompt]  # (p, V): offset o predicts tokens[o + 1]
    predicted = [o + 1 for o in offsets[:num_prompt]]
    if predicted[-1] == work.num_new:  # predicts the next step's first token: kept for then
        work.next_prompt_logits = prompt_logits[-1]
        prompt_logits, predicted = prompt_logits[:-1], predicted[:-1]
    if predicted:
        next_ids = work.tokens[predicted].to(prompt_logits.device)
        work.prompt_pieces.append(logprob_arrays(work.row, prompt_logits, next_ids, work.params, None,
                                                 work.row.logprobs.prompt_logprobs, with_masks=False)[0])


def run_forwards(verifier: Verifier, works: list[VerifyRowWork]) -> None:
    """Feed every row's tokens, chunk by chunk; a failed forward fails only its rows."""
    pending = [w for w in works if w.fed < len(w.tokens)]  # fed: what the prefix cache gave
    while pending:
        chunks = [(w, w.fed, min(len(w.tokens), w.fed + verifier.prefill_chunk)) for w in pending]
        forward_each(verifier, pack_chunks(chunks), forward_group)
        pending = [w for w in pending if w.error is None and w.fed < len(w.tokens)]


def forward_each(verifier: Verifier, groups: list[list[tuple[VerifyRowWork, int, int]]],
                 forward_one: Callable[[Verifier, list[tuple[VerifyRowWork, int, int]]], None]) -> None:
    """forward_one(verifier, group) for each group of (work, begin, end) chunks (forward_group,
    or verifier_trees.py's forward_trees); a failed forward fails only its rows."""
    for group in groups:
        try:
            forward_one(verifier, group)
        except Exception as exc:
            log.exception("verify_forward_failed", rows=len(group))
            for work, _, _ in group:
                work.error = Error.from_exception(exc, work.row.request_id)
