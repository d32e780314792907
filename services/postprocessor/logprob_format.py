"""Logprob formatting: a verifier's LogprobArrays into the TokenLogprobs a client reads
(docs/PROTOCOL.md#logprobs-and-sampling-masks).

`format_logprobs` is the one conversion (raw values as they are; processed ones normalised by
the candidate set K); `token_extras` builds a chunk's per-token fields from its joined record,
`prompt_logprobs` the first chunk's prompt logprobs from every prefill record. Pure functions
of their arguments (the tokenizer decodes each token's text). Torch-free.
"""

from __future__ import annotations

import math

import numpy as np

from schemas.arrays import PAD_TOKEN_ID
from schemas.commits import LogprobArrays, SideChannelRecord
from schemas.generation import LogprobOptions
from schemas.streams import SamplingMask, TokenLogprob
from text.tokenizer import Tokenizer


def wants_token_logprobs(options: LogprobOptions) -> bool:
    """The request asked logprobs of its completion tokens (top-n or of given ids)."""
    return options.logprobs is not None or len(options.logprob_token_ids) > 0


def format_logprobs(arrays: LogprobArrays, token_ids: list[int], *, mode: str, top_n: int, requested_ids: list[int],
                    tokenizer: Tokenizer, masks: list[SamplingMask] | None = None,
                    rows: list[int] | None = None) -> list[TokenLogprob]:
    """TokenLogprobs for token_ids from rows `rows` of arrays (default 0..len-1).

    mode "raw": values as they are. mode "processed": value - logz_k (LogprobArrays), and -inf
    for ids outside K when the position's mask lists K in full (the verifier already sends
    -inf for them; the mask check makes it hold for any sender). top-n drops PAD_TOKEN_ID padding.
    """
    rows = list(range(len(token_ids))) if rows is None else rows
    assert len(rows) == len(token_ids), f"{len(rows)} rows for {len(token_ids)} tokens"
    out = []
    for index, (row, token_id) in enumerate(zip(rows, token_ids)):
        norm = float(arrays.logz_k[row]) if mode == "processed" else 0.0
        mask = masks[index] if masks is not None else None
        in_k = set(mask.token_ids.tolist()) if mode == "processed" and mask is not None and not (
            mask.all_tokens or mask.truncated) else None

        def value(id_: int, raw: float) -> float:
            return -math.inf if in_k is not None and id_ not in in_k else raw - norm

        top_ids = arrays.top_ids[row]
        keep = top_ids != PAD_TOKEN_ID
        top_ids = top_ids[keep][:top_n]
        top_logprobs = [value(i, v) for i, v in zip(top_ids.tolist(), arrays.top_logprobs[row][keep][:top_n].tolist())]
        requested = [value(i, v) for i, v in zip(requested_ids, arrays.requested_logprobs[row].tolist())]
        out.append(TokenLogprob(
            token_id=token_id, logprob=value(token_id, float(arrays.token_logprobs[row])),
            rank=None if arrays.ranks is None else int(arrays.ranks[row]), token=tokenizer.decode([token_id]),
            top_ids=top_ids, top_logprobs=np.asarray(top_logprobs, np.float32),
            requested_logprobs=np.asarray(requested, np.float32)))
    return out


def token_extras(options: LogprobOptions, record: SideChannelRecord | None, token_ids: np.ndarray,
                 tokenizer: Tokenizer) -> dict:
    """A chunk's `logprobs` and `sampling_masks` for token_ids from its joined record, as the
    request asked them; {} without a record (the chunk then goes out without them)."""
    wants_logprobs = wants_token_logprobs(options)
    if record is None or not (wants_logprobs or options.sampling_mask):
        return {}
    masks = None if record.masks is None else record.masks[:len(token_ids)]
    extras: dict = {}
    if options.sampling_mask:
        extras["sampling_masks"] = masks or []  # side_channel_join.record_fits: present when there are tokens
    if wants_logprobs:
        extras["logprobs"] = format_logprobs(
            record.logprobs, token_ids.tolist(), mode=record.mode, top_n=options.logprobs or 0,
            requested_ids=options.logprob_token_ids.tolist(), masks=masks, tokenizer=tokenizer)
    return extras


def prompt_logprobs(options: LogprobOptions, records: list[SideChannelRecord], prompt_token_ids: np.ndarray,
                    tokenizer: Tokenizer) -> list[TokenLogprob | None]:
    """One entry per prompt position from the prompt logprobs of records (one per prefill
    chunk); None where no record covers it (position 0 always: it has no context)."""
    prompt_ids = prompt_token_ids.tolist()
    entries: list[TokenLogprob | None] = [None] * len(prompt_ids)
    for record in records:
        arrays, offset = record.prompt_logprobs, record.prompt_offset
        positions = [p for p in range(offset, offset + arrays.n) if 1 <= p < len(prompt_ids)]
        formatted = format_logprobs(
            arrays, [prompt_ids[p] for p in positions], mode=record.mode, top_n=options.prompt_logprobs,
            requested_ids=options.logprob_token_ids.tolist(), rows=[p - offset for p in positions],
            tokenizer=tokenizer)
        for position, entry in zip(positions, formatted):
            entries[position] = entry
    return entries
