"""The verifier's side channel: logprobs and sampling masks of the emitted tokens and of the
prompt, as LogprobArrays (`logprob_arrays`), kept across prefill chunks until the prompt is
complete (`continue_prompt`), and one SideChannelRecord per row that wants it (`side_record`).

Logprob values follow LogprobArrays: raw mode = log_softmax(logits) of the model's logits;
processed mode = log_softmax(logits / T) of the penalised logits with logz_k, the reader
subtracting logz_k (ids outside K are -inf). Prompt logprobs score the prompt without logit_bias
or penalties: those shape what is generated.
"""

from __future__ import annotations

import numpy as np
import structlog
import torch

from gpu_worker.verifier.verifier_state import Verified, Verifier, VerifyRowWork
from gpu_worker.sampling.logprobs import TokenLogprobs, gather_logprobs
from gpu_worker.sampling.sampler import ProcessedLogits, SamplingTensors
from schemas.commits import LogprobArrays, SideChannelRecord
from schemas.steps import VerifyRow
from schemas.streams import SamplingMask

log = structlog.get_logger(__name__)


def logprob_arrays(row: VerifyRow, logits: torch.Tensor, token_ids: torch.Tensor, params: SamplingTensors,
                   processed: ProcessedLogits | None, top_n: int, *, with_masks: bool,
                   raw_logits: torch.Tensor | None = None) -> tuple[LogprobArrays, list[SamplingMask] | None]:
    """LogprobArrays (and masks) for tokens (n,) drawn from logits (n, V) under the row's params.

    processed: the sampler's output at these positions (emitted tokens) or None (prompt
    positions and greedy batches: K from the sampler's own select_candidates). raw_logits
    (n, V): the model's logits where logits are penalised (raw mode reports those).
    """
    options = row.logprobs
    n = len(token_ids)
    requested = torch.from_numpy(options.logprob_token_ids).long().to(logits.device)
    _, _, lp = gather_logprobs(logits[None], token_ids[None], params, processed,
                               raw_logits=None if raw_logits is None else raw_logits[None],
                               mode=options.logprobs_mode, top_n=top_n, requested_ids=requested[None].expand(n, -1),
                               mask_cap=options.max_mask_size if with_masks else 1)
    processed_mode = options.logprobs_mode == "processed"
    # processed mode ships log_softmax(logits / T) and logz_k; the reader subtracts logz_k once
    shift = lp.logz_k[:, None] if processed_mode else 0.0
    token_values = lp.processed_logprobs + lp.logz_k if processed_mode else lp.raw_logprobs
    ranked = logits if processed_mode or raw_logits is None else raw_logits  # ranks in the reported distribution
    ranks = (ranked > ranked.gather(1, token_ids[:, None])).sum(-1) + 1
    arrays = LogprobArrays(
        token_logprobs=to_numpy(token_values, np.float32),
        top_ids=to_numpy(lp.top_ids, np.int32),
        top_logprobs=to_numpy(lp.top_logprobs + shift, np.float32),
        requested_logprobs=to_numpy(lp.requested_logprobs + shift, np.float32),
        ranks=to_numpy(ranks, np.int32),
        logz_k=to_numpy(lp.logz_k, np.float32) if processed_mode else None,
    )
    return arrays, masks_of(lp) if with_masks else None


def to_numpy(x: torch.Tensor, dtype) -> np.ndarray:
    return x.detach().cpu().numpy().astype(dtype)


def masks_of(lp: TokenLogprobs) -> list[SamplingMask]:
    candidate_ids = lp.candidate_ids.cpu().numpy()
    return [SamplingMask(token_ids=ids[ids >= 0].astype(np.int32), size=int(size), all_tokens=bool(everything))
            for ids, size, everything in zip(candidate_ids, lp.num_candidates.tolist(), lp.candidates_all.tolist())]


def slice_arrays(arrays: LogprobArrays, stop: int) -> LogprobArrays:
    """The first `stop` positions."""
    return LogprobArrays(**{name: None if getattr(arrays, name) is None else getattr(arrays, name)[:stop]
                            for name in LogprobArrays.model_fields})


def concat_arrays(pieces: list[LogprobArrays]) -> LogprobArrays:
    """Pieces over consecutive positions -> one LogprobArrays."""
    if len(pieces) == 1:
        return pieces[0]
    fields = {}
    for name in LogprobArrays.model_fields:
        values = [getattr(p, name) for p in pieces]
        fields[name] = None if values[0] is None else np.concatenate(values)
    return LogprobArrays(**fields)


def side_record(verifier: Verifier, work: VerifyRowWork, batch_id: int, verified: Verified | None,
                prompt: LogprobArrays | None, prompt_offset: int) -> SideChannelRecord:
    row = work.row
    options = row.logprobs
    logprobs = masks = None
    token_ids = np.zeros(0, np.int32)
    if verified is not None:
        token_ids = verified.token_ids.numpy().astype(np.int32)
        wants_logprobs = options.logprobs is not None or len(options.logprob_token_ids) > 0
        if wants_logprobs or options.sampling_mask:
            arrays, masks = logprob_arrays(row, verified.logits, verified.token_ids.to(verified.logits.device),
                                           work.params, verified.processed, options.logprobs or 0,
                                           with_masks=options.sampling_mask, raw_logits=verified.raw_logits)
            logprobs = arrays if wants_logprobs else None
    return SideChannelRecord(request_id=row.request_id, batch_id=batch_id, step=row.step,
                             verifier_id=verifier.instance_id, mode=options.logprobs_mode, token_ids=token_ids,
                             logprobs=logprobs, masks=masks, prompt_logprobs=prompt, prompt_offset=prompt_offset)


def continue_prompt(verifier: Verifier, work: VerifyRowWork) -> None:
    """Start this step's prompt logprobs from what the request's state holds: positions
    1..start-1 and the logits that give position `start` (the chunk went on where the last
    one stopped), or logprobs already past `start` (the slot was rewound). Otherwise the
    logprob of position `start` cannot be had any more: counted, and the record starts after it."""
    state, start, row = work.state, work.start, work.row
    if start == 0:
        return
    stored = state.prompt_logprobs
    if state.prompt_end == start and state.prompt_logits is not None:
        first_id = work.tokens[:1].to(state.prompt_logits.device)
        piece, _ = logprob_arrays(row, state.prompt_logits[None], first_id, work.params, None,
                                  row.logprobs.prompt_logprobs, with_masks=False)
        work.prompt_pieces = ([] if stored is None else [stored]) + [piece]
        work.prompt_offset = state.prompt_offset
    elif stored is not None and state.prompt_offset <= start + 1 <= state.prompt_end:
        kept = start + 1 - state.prompt_offset
        work.prompt_pieces = [slice_arrays(stored, kept)] if kept else []
        work.prompt_offset = state.prompt_offset
    else:
        verifier.counters["prompt_logprobs_lost"] += 1
        log.warning("prompt_logprob_lost", request_id=row.request_id, position=start)
        work.prompt_offset = start + 1

