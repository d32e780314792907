"""The verifier's drafts (step 4 of gpu_worker/verifier/verifier_core.py), for the emitting rows
of a step, batched, chains and trees alike: the rows' padded logits and drafts with each row's
grammar mask, logit_bias and penalties applied (`penalised_logits` for chains, whose position t
counts drafts 0..t-1; `path_penalised` for trees, whose column counts the nodes on its path), the
rows as a DraftTree with their laws (`row_laws`), then the one acceptance entry point
(gpu_worker/sampling/acceptance.py `accept`); a batch that fails goes again row by row
(`verify_each`).
"""

from __future__ import annotations

import structlog
import torch

from gpu_worker.batching.grammar_masks import mask_logits_
from gpu_worker.runtime.tree_forward import ROOT, tree_paths
from gpu_worker.sampling.acceptance import DraftTree, Law, RowLaws, accept
from gpu_worker.sampling.sampler import Penalties, SamplingInputError, SamplingTensors, penalise, row_seed
from gpu_worker.verifier.verifier_state import Verified, Verifier, VerifyRowWork
from schemas.arrays import PAD_TOKEN_ID
from schemas.bus.wire import Error
from schemas.errors import ErrorCode
from schemas.generation import RowSampling
from schemas.steps import VerifyRow

log = structlog.get_logger(__name__)


def verify_drafts(verifier: Verifier, works: list[VerifyRowWork]) -> list[Verified]:
    """Step 4 for emitting rows, batched, all chains or all trees (tree rows have parents): each
    row's Verified, in works' order."""
    device = verifier.model.embed.device
    N = max(w.num_draft for w in works)
    logits = padded_logits(works, N)  # (B, N+1, V): column c's logits, padding columns repeat the last
    draft_ids = padded_drafts(works, N, device)  # (B, N)
    num_nodes = torch.tensor([w.num_draft for w in works], dtype=torch.long)
    draft_laws = [w.draft_probs for w in works]
    if works[0].parents is None:
        tree = DraftTree.of_chain(draft_ids, num_nodes, draft_laws)
        penalised = penalised_logits(works, logits, draft_ids)
    else:
        tree = DraftTree(draft_ids, tree_parents(works, N), num_nodes, draft_laws)
        penalised = path_penalised(works, logits, draft_ids, tree.parents, num_nodes)
    accepted = accept(tree, penalised, row_laws(works, device))
    return [Verified(token_ids=accepted.token_ids[b], num_accepted=accepted.num_accepted[b],
                     residual_fallback=accepted.residual_fallback[b], logits=penalised[b, cols],
                     raw_logits=logits[b, cols] if w.adjusted else None, processed=accepted.laws[b],
                     accepted_nodes=None if tree.chain else accepted.paths[b])
            for b, (w, cols) in enumerate(zip(works, accepted.columns))]


def row_laws(works: list[VerifyRowWork], device) -> RowLaws:
    """The rows' laws as `accept` takes them: GREEDY, GUMBEL (a Gumbel-coupled sampled row) or
    REJECTION; their sampling tensors, seeds and the stream position where the first token after
    their new tokens lands, on device."""
    law = [Law.GREEDY if w.row.sampling.greedy else Law.GUMBEL if w.row.sampling.gumbel else Law.REJECTION
           for w in works]
    seeds = torch.tensor([row_seed(w.row.sampling) for w in works], dtype=torch.long, device=device)
    first = torch.tensor([w.start + w.num_new for w in works], dtype=torch.long, device=device)
    return RowLaws(torch.tensor(law, dtype=torch.long, device=device), SamplingTensors.cat([w.params for w in works]),
                   seeds, first)


def tree_parents(works: list[VerifyRowWork], N: int) -> torch.Tensor:
    """The tree rows' parents (B, N) int64 on CPU, ROOT past a row's nodes."""
    parents = torch.full((len(works), N), ROOT, dtype=torch.long)
    for b, w in enumerate(works):
        parents[b, :w.num_draft] = w.parents
    return parents


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


def penalised_logits(works: list[VerifyRowWork], logits: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """logits (B, K+1, V) with each row's grammar mask (verifier_grammar.py), logit_bias and
    penalties applied (float32), verify position t counting drafts 0..t-1; the same tensor when
    no row has any. A row with a grammar only gets its mask alone (no penalties to build: adding
    zeros changes no logit's value). draft_ids (B, K), -1 padded."""
    if not any(w.adjusted for w in works):
        return logits
    out = logits.to(torch.float32, copy=True)
    for b, w in enumerate(works):  # the grammar first, as vLLM applies its bitmask before the penalties
        if w.allowed is not None:
            mask_logits_(out[b, :w.num_draft + 1], w.allowed)
    rows = [b for b, w in enumerate(works) if w.penalties is not None]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        out[index] = penalise(out[index], Penalties.cat([works[b].penalties for b in rows]), draft_ids[index])
    return out


def path_penalised(works: list[VerifyRowWork], logits: torch.Tensor, draft_ids: torch.Tensor, parents: torch.Tensor,
                   num_nodes: torch.Tensor) -> torch.Tensor:
    """logits (B, J, V) with each penalised row's logit_bias and penalties applied (float32),
    column c counting the output then the tokens of the nodes on its path (penalise's rule for a
    chain, whose position t has drafts 0..t-1 on its path); the same tensor when no row has any.
    draft_ids (B, J-1), -1 padded; parents (B, J-1) and num_nodes (B,) on CPU."""
    rows = [b for b, w in enumerate(works) if w.penalties is not None]
    if not rows:
        return logits
    (B, J, V), R, device = logits.shape, len(rows), logits.device
    on_path = torch.zeros(R, J, J - 1)  # [r, c, i]: node i is on column c's path
    for r, paths in enumerate(tree_paths(parents[rows], num_nodes[rows])):
        for c, path in enumerate(paths):
            on_path[r, c, [column - 1 for column in path[1:]]] = 1.0
    index = torch.tensor(rows, device=device)
    drafts = draft_ids[index]  # (R, J-1)
    one_hot = torch.zeros(R, J - 1, V, device=device)
    one_hot.scatter_(-1, drafts.clamp_min(0)[..., None], (drafts >= 0)[..., None].float())
    drafted = torch.bmm(on_path.to(device), one_hot)  # (R, J, V): counts of small integers, exact
    base = Penalties.cat([works[b].penalties for b in rows])
    per_column = Penalties(base.bias.repeat_interleave(J, 0), (base.output_counts[:, None] + drafted).flatten(0, 1),
                           (base.seen[:, None] | (drafted > 0)).flatten(0, 1),
                           *(getattr(base, name).repeat_interleave(J) for name in ("repetition", "frequency",
                                                                                    "presence")))
    out = logits.to(torch.float32, copy=True)
    out[index] = penalise(out[index].reshape(R * J, 1, V), per_column).view(R, J, V)
    return out


def verify_each(verifier: Verifier, works: list[VerifyRowWork]) -> list[Verified | None]:
    """verify_drafts for all rows at once (all chains or all trees); if that fails, row by row, so
    one bad row (e.g. non-finite logits) fails alone."""
    try:
        return verify_drafts(verifier, works)
    except Exception:
        log.exception("verify_batch_sampling_failed", rows=len(works))
    verified: list[Verified | None] = []
    for work in works:
        try:
            verified.append(verify_drafts(verifier, [work])[0])
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

