"""The verifier's drafts (step 4 of gpu_worker/verifier/verifier_core.py), for the emitting rows
of a step, batched: logit_bias and penalties (`penalised_logits`), the target's distributions
and draws (`target_draws`), and the rejection sampler (`verify_sampled`), or for a batch of
greedy rows the argmaxes alone (`verify_greedy`); a batch that fails goes again row by row
(`verify_each`). The pieces a tree row's verify shares (gpu_worker/verifier/verifier_trees.py) are
here too: padded logits and drafts, target draws, draft laws, the rows' Verified.
"""

from __future__ import annotations

from typing import Callable

import structlog
import torch
import torch.nn.functional as F

from gpu_worker.batching.grammar_masks import mask_logits
from gpu_worker.verifier.verifier_state import Verified, Verifier, VerifyRowWork
from gpu_worker.sampling.coupling import coupled_sample
from gpu_worker.sampling.rejection import RejectionResult, greedy_accepted, rejection_sample
from gpu_worker.sampling.sampler import (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TARGET, Penalties, ProcessedLogits,
                                         SamplingInputError, SamplingTensors, check_finite_logits, make_uniforms,
                                         penalise, row_seed)
from schemas.arrays import PAD_TOKEN_ID
from schemas.errors import ErrorCode
from schemas.generation import RowSampling
from schemas.steps import VerifyRow
from schemas.bus.wire import Error

log = structlog.get_logger(__name__)


def verify_drafts(verifier: Verifier, works: list[VerifyRowWork]) -> list[Verified]:
    """Steps 4 for emitting rows, batched: target samples, rejection sampler, in works' order."""
    device = verifier.model.embed.device
    K = max(w.num_draft for w in works)
    logits = padded_logits(works, K)  # (B, K+1, V)
    draft_ids = padded_drafts(works, K, device)
    raw_logits, logits = logits, penalised_logits(works, logits, draft_ids)
    all_greedy = all(w.row.sampling.greedy for w in works)
    if greedy_rule(works) and not all_greedy:
        return walked_rows(works, logits, raw_logits, draft_ids, chain_parents_of(works, K), tree=False)
    if all_greedy:
        token_ids, num_accepted = verify_greedy(logits, draft_ids)
        residual_fallback, processed = [False] * len(works), None
    else:
        result, processed = verify_sampled(works, logits, draft_ids)
        token_ids, num_accepted = result.token_ids, result.num_accepted.tolist()
        residual_fallback = result.residual_fallback.tolist()
    return verified_rows(works, token_ids.cpu(), num_accepted, residual_fallback, logits, raw_logits, processed,
                         [slice(0, n + 1) for n in num_accepted])


def padded_logits(works: list[VerifyRowWork], K: int) -> torch.Tensor:
    """Each row's verify logits (k+1, V), stacked (B, K+1, V); slots past a row's drafts repeat
    its last logits."""
    logits = []
    for w in works:
        row_logits = torch.cat(w.verify_logits)  # (k+1, V)
        logits.append(torch.cat([row_logits, row_logits[-1:].expand(K - w.num_draft, -1)]))
    return torch.stack(logits)


def padded_drafts(works: list[VerifyRowWork], K: int, device) -> torch.Tensor:
    """Each row's draft tokens, (B, K) int64 on device, PAD_TOKEN_ID past a row's drafts."""
    draft_ids = torch.full((len(works), K), PAD_TOKEN_ID, dtype=torch.long)
    for b, w in enumerate(works):
        draft_ids[b, :w.num_draft] = w.tokens[w.num_new:]
    return draft_ids.to(device)


def verified_rows(works: list[VerifyRowWork], token_ids: torch.Tensor, num_accepted: list[int],
                  residual_fallback: list[bool], logits: torch.Tensor, raw_logits: torch.Tensor,
                  processed: ProcessedLogits | None, columns: list,
                  accepted_nodes: list | None = None) -> list[Verified]:
    """Each row's Verified: token_ids (B, T) CPU, its first num_accepted[b] + 1 emitted; logits,
    raw_logits (B, T', V) and processed taken at columns[b] (a slice or an index tensor), the
    verify positions its emitted tokens were drawn at; accepted_nodes[b] for a tree row."""
    verified = []
    for b, cols in enumerate(columns):
        n = num_accepted[b] + 1
        rows = slice(b, b + 1)
        verified.append(Verified(
            token_ids=token_ids[b, :n], num_accepted=n - 1, residual_fallback=residual_fallback[b],
            logits=logits[b, cols], raw_logits=None if works[b].penalties is None else raw_logits[b, cols],
            processed=None if processed is None else
            ProcessedLogits(processed.probs[rows, cols], processed.candidate_ids[rows, cols],
                            processed.num_candidates[rows, cols]),
            accepted_nodes=None if accepted_nodes is None else accepted_nodes[b]))
    return verified


def penalised_logits(works: list[VerifyRowWork], logits: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """logits (B, K+1, V) with each penalised row's grammar mask (verifier_grammar.py), logit_bias and
    penalties applied (float32),
    verify position t counting drafts 0..t-1; the same tensor when no row has any.
    draft_ids (B, K), -1 padded."""
    rows = [b for b, w in enumerate(works) if w.penalties is not None]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    for b, w in enumerate(works):  # the grammar first, as vLLM applies its bitmask before the penalties
        if w.allowed is not None:
            out[b, :w.num_draft + 1] = mask_logits(out[b, :w.num_draft + 1], w.allowed)
    index = torch.tensor(rows, device=logits.device)
    out[index] = penalise(out[index], Penalties.cat([works[b].penalties for b in rows]), draft_ids[index])
    return out


def verify_greedy(logits: torch.Tensor, draft_ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """rejection_sample's greedy path without the distributions, uniforms and checks it does not
    need (see ops/bench/RESULTS.md, Figures behind gpu_worker's choices): a draft is accepted
    while it equals the target's argmax (lowest id on ties, as process_logits), so the emitted
    tokens are the argmaxes at positions 0..num_accepted.

    logits (B, K+1, V); draft_ids (B, K) int64, -1 past a row's drafts (never an argmax).
    Returns the argmaxes (B, K+1) int64 and num_accepted per row.
    """
    B, K = draft_ids.shape
    assert logits.shape[:2] == (B, K + 1), (logits.shape, draft_ids.shape)
    check_finite_logits(logits)  # the same check (and error) as process_logits
    target_ids = logits.argmax(-1)
    return target_ids, greedy_accepted(draft_ids, target_ids).tolist()


def verify_sampled(works: list[VerifyRowWork], logits: torch.Tensor,
                   draft_ids: torch.Tensor) -> tuple[RejectionResult, ProcessedLogits]:
    """Target samples and the rejection sampler for a batch with sampled rows (greedy rows in it
    take the sampler's argmax path). logits (B, K+1, V); draft_ids (B, K), -1 padded."""
    (B, K), device = draft_ids.shape, logits.device
    seeds, first = seeds_and_first(works, device)
    positions = first[:, None] + torch.arange(K + 1, device=device)  # (B, K+1): where each sample lands
    processed, target_ids, greedy = target_draws(works, logits, seeds, positions)
    num_draft = torch.tensor([w.num_draft for w in works], dtype=torch.long, device=device)
    result = rejection_sample(draft_ids, num_draft, stacked_draft_probs(works, draft_ids, logits.shape[-1]),
                              processed.probs, target_ids, greedy,
                              uniforms=make_uniforms(seeds, positions[:, :K], STREAM_ACCEPT),
                              residual_uniforms=make_uniforms(seeds, positions[:, :K], STREAM_RESIDUAL))
    return result, processed


def greedy_rule(works: list[VerifyRowWork]) -> bool:
    """Whether every row accepts by the greedy rule (greedy and Gumbel-coupled rows): then only
    the positions the acceptance walks need the target's law (`walk_draws`)."""
    return all(w.row.sampling.greedy or w.row.sampling.gumbel for w in works)


def chain_parents_of(works: list[VerifyRowWork], K: int) -> torch.Tensor:
    """Chains as trees: parents (B, K) int64, node j's parent j - 1 (-1 for the first)."""
    return (torch.arange(K) - 1).expand(len(works), K)


def walk_draws(works: list[VerifyRowWork], logits: torch.Tensor, draft_ids: torch.Tensor,
               parents: torch.Tensor) -> tuple[list[list[int]], list[list[int]], list[ProcessedLogits | None]]:
    """The greedy rule's walk (docs/PROTOCOL.md#tree-drafts) with the target's laws and draws
    taken only where it reads them: at the root, then at the child equal to the draw there, and
    so on, a batched `coupled_sample` a depth over the rows still walking, where `target_draws`
    takes every column. Each column's law and draw is computed alone (`process_logits` is per
    position, the noise and uniforms keyed by the stream position root + depth), so both give
    the same bits where the walk goes; the columns it never reaches cost nothing.

    logits (B, J, V) per column (0 the root, c node c - 1); draft_ids (B, N), -1 past a row's
    nodes; parents (B, N) int64 (-1: a child of the root; a chain's node j has parent j - 1).
    Returns per row the accepted nodes, the emitted tokens (the path's drafts, then the draw
    after it) and the laws they were drawn from, ProcessedLogits [1, n, ...]; for a batch of
    greedy rows the argmaxes alone and no laws (None), as `verify_greedy`."""
    B, device = len(works), logits.device
    greedy = all(w.row.sampling.greedy for w in works)
    seeds, first = seeds_and_first(works, device)
    kids = [{} for _ in range(B)]                                    # per row: parent node -> its nodes, in order
    for b, (row_parents, row_drafts) in enumerate(zip(parents.tolist(), draft_ids.tolist())):
        for node, (parent, token) in enumerate(zip(row_parents, row_drafts)):
            if token >= 0:
                kids[b].setdefault(parent, []).append((node, token))
    paths, tokens, laws = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    walking = list(range(B))
    while walking:
        rows = torch.tensor(walking, device=device)
        at = torch.tensor([paths[b][-1] + 1 if paths[b] else 0 for b in walking], device=device)
        positions = first[rows, None] + torch.tensor([[len(paths[b])] for b in walking], device=device)
        if greedy:
            column = logits[rows, at][:, None]
            check_finite_logits(column)  # the same check (and error) as process_logits
            processed, draws = None, column.argmax(-1)
        else:
            params = SamplingTensors.cat([works[b].params for b in walking])
            processed, draws = coupled_sample(logits[rows, at][:, None], params,
                                              make_uniforms(seeds[rows], positions, STREAM_TARGET),
                                              torch.tensor([works[b].row.sampling.gumbel for b in walking],
                                                           device=device), seeds[rows], positions)
        still = []
        for i, (b, draw) in enumerate(zip(walking, draws[:, 0].tolist())):
            tokens[b].append(draw)
            if processed is not None:
                laws[b].append(ProcessedLogits(processed.probs[i:i + 1], processed.candidate_ids[i:i + 1],
                                               processed.num_candidates[i:i + 1]))
            child = next((node for node, token in kids[b].get(paths[b][-1] if paths[b] else -1, ()) if token == draw),
                         None)
            if child is not None:
                paths[b].append(child)
                still.append(b)
        walking = still
    return paths, tokens, [joined_laws(row) if row else None for row in laws]


def joined_laws(laws: list[ProcessedLogits]) -> ProcessedLogits:
    """ProcessedLogits [1, 1, ...] of consecutive positions joined along T (candidate ids padded
    with 0 past each one's width: past num_candidates they are not read)."""
    width = max(law.candidate_ids.shape[-1] for law in laws)
    return ProcessedLogits(torch.cat([law.probs for law in laws], 1),
                           torch.cat([F.pad(law.candidate_ids, (0, width - law.candidate_ids.shape[-1]))
                                      for law in laws], 1),
                           torch.cat([law.num_candidates for law in laws], 1))


def walked_rows(works: list[VerifyRowWork], logits: torch.Tensor, raw_logits: torch.Tensor, draft_ids: torch.Tensor,
                parents: torch.Tensor, tree: bool) -> list[Verified]:
    """Each row's Verified from `walk_draws` (tree: with its accepted nodes)."""
    paths, tokens, laws = walk_draws(works, logits, draft_ids, parents)
    verified = []
    for b, (path, emitted, law) in enumerate(zip(paths, tokens, laws)):
        cols = torch.tensor([0] + [node + 1 for node in path], device=logits.device)
        verified.append(Verified(
            token_ids=torch.tensor(emitted, dtype=torch.long), num_accepted=len(path), residual_fallback=False,
            logits=logits[b, cols], raw_logits=None if works[b].penalties is None else raw_logits[b, cols],
            processed=law, accepted_nodes=path if tree else None))
    return verified


def seeds_and_first(works: list[VerifyRowWork], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's seed (B,) and the stream position (B,) where the first token after its new
    tokens lands, int64 on device."""
    seeds = torch.tensor([row_seed(w.row.sampling) for w in works], dtype=torch.long, device=device)
    return seeds, torch.tensor([w.start + w.num_new for w in works], dtype=torch.long, device=device)


def target_draws(works: list[VerifyRowWork], logits: torch.Tensor, seeds: torch.Tensor,
                 positions: torch.Tensor) -> tuple[ProcessedLogits, torch.Tensor, torch.Tensor]:
    """The target's laws and draws at logits (B, T, V), the draws keyed by (seeds (B,), positions
    (B, T), STREAM_TARGET): (processed, target_ids (B, T), greedy (B,) bool: the rows the
    acceptance takes by the greedy rule, greedy and Gumbel-coupled ones)."""
    params = SamplingTensors.cat([w.params for w in works])
    # Gumbel-coupled rows: the target's draw is the Gumbel-max one and a draft is accepted iff it
    # equals it, which is the greedy rule over these draws (gpu_worker/sampling/coupling.py)
    gumbel = torch.tensor([w.row.sampling.gumbel for w in works], device=logits.device)
    processed, target_ids = coupled_sample(logits, params, make_uniforms(seeds, positions, STREAM_TARGET), gumbel,
                                           seeds, positions)
    return processed, target_ids, params.greedy | gumbel


def stacked_draft_probs(works: list[VerifyRowWork], draft_ids: torch.Tensor, V: int) -> torch.Tensor | None:
    """The rows' draft laws (B, K, V), a point mass where a row has none (draft_ids (B, K), -1
    padded); None when no row has any (the samplers then take every draft as a point mass)."""
    if all(w.draft_probs is None for w in works):
        return None
    B, K = draft_ids.shape
    one_hot = torch.zeros(B, K, V, device=draft_ids.device)
    one_hot.scatter_(-1, draft_ids.clamp_min(0)[..., None], 1.0)
    return torch.stack([one_hot[b] if w.draft_probs is None else torch.cat([w.draft_probs, one_hot[b, w.num_draft:]])
                        for b, w in enumerate(works)])  # (B, K, V)


VerifyRows = Callable[[Verifier, list[VerifyRowWork]], list[Verified]]  # verify_drafts, verify_trees


def verify_each(verifier: Verifier, works: list[VerifyRowWork],
                verify: VerifyRows = verify_drafts) -> list[Verified | None]:
    """verify (verify_drafts, or verifier_trees.py's verify_trees) for all rows at once; if that
    fails, row by row, so one bad row (e.g. non-finite logits) fails alone."""
    try:
        return verify(verifier, works)
    except Exception:
        log.exception("verify_batch_sampling_failed", rows=len(works))
    verified: list[Verified | None] = []
    for work in works:
        try:
            verified.append(verify(verifier, [work])[0])
        except Exception as exc:
            log.exception("verify_row_failed", request_id=work.row.request_id)
            work.error = row_failure(exc, work.row)
            verified.append(None)
    return verified


def row_failure(exc: Exception, row: VerifyRow) -> Error:
    """The error of one row the sampler failed on: a sampling value names its field in the
    batch ("rows[i].sampling.top_p"); any other kernel input (e.g. non-finite logits from the
    model) is `internal`, with the kernel's message."""
    if isinstance(exc, SamplingInputError) and exc.field in RowSampling.model_fields:
        return Error(code=exc.code, message=exc.message, field=f"rows[{row.row}].sampling.{exc.field}",
                     request_id=row.request_id)
    if isinstance(exc, SamplingInputError):
        return Error(code=ErrorCode.internal, message=f"{exc.field}: {exc.message}", request_id=row.request_id)
    return Error.from_exception(exc, row.request_id)

