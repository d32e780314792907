"""Structured outputs in the verifier (docs/PROTOCOL.md#structured-outputs): the grammar's
allowed tokens at every verified position of a row, and the forced tokens it adds as drafts.

A row with `sampling.structured_outputs` keeps an OutputMatcher in its slot, brought each step
to the state after the row's output so far (the tokens after prompt_len, from the slot and
new_token_ids; a migration or resync rebuilds it from them, as the KV cache). Then, for
verified positions t = 0..k: allowed[t] = the tokens the grammar permits after the output and
drafts 0..t-1, the mask the target's law at t is restricted to (`mask_logits`, before
logit_bias and penalties, as vLLM applies its grammar bitmask). A draft the grammar refuses has
target probability 0, so it is rejected whatever the sampling; positions after it are never
emitted and repeat its mask. When every draft is allowed, the tokens the grammar then forces
(`OutputMatcher.forced`, up to the row's max_forced) are appended as point-mass drafts: the
target computes their KV and logprobs like any draft, and under the masked law a token that is
the only one allowed is accepted with probability 1. The matcher is rolled back to the output
afterwards; the next step's `follow` takes whatever was accepted.
"""

from __future__ import annotations

import numpy as np
import torch
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from schemas.errors import ErrorCode, SpecbusError
from schemas.steps import VerifyRow
from text.grammar import FIELD, Grammars, OutputMatcher, llg_tokenizer
from text.tokenizer import load_tokenizer

BITS = torch.arange(32, dtype=torch.int32)


def grammars_of(verifier) -> Grammars:
    """The verifier's compiled grammars, made on first use (a verifier without grammars loads no tokenizer)."""
    if verifier.grammars is None:
        verifier.grammars = Grammars(llg_tokenizer(load_tokenizer(verifier.tokenizer_dir), verifier.vocab_size))
    return verifier.grammars


def unpack(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (n, ceil(V/32)) int32, bit j of word w = token 32w + j -> (n, V) bool."""
    words = torch.from_numpy(bitmask)
    return ((words[..., None] >> BITS) & 1).view(words.shape[0], -1)[:, :vocab_size].bool()


def row_grammar(verifier, row: VerifyRow, matcher: OutputMatcher | None, output: list[int], prefix: str,
                max_forced: int) -> tuple[OutputMatcher, list[int], torch.Tensor]:
    """The row's matcher (matcher, or a fresh one), the forced tokens to append after its drafts
    (at most max_forced) and allowed (k + 1 + #forced, V) bool. output: the row's output tokens
    before its first verified position. SpecbusError naming the field when the grammar does not
    compile, the output breaks it or it allows nothing."""
    field = f"{prefix}.{FIELD}"
    spec = row.sampling.structured_outputs
    try:
        matcher = matcher or OutputMatcher(grammars_of(verifier).matcher(spec))
    except SpecbusError as exc:
        raise SpecbusError(exc.code, exc.message, field) from None
    if not matcher.follow(output):
        raise SpecbusError(ErrorCode.invalid_field, "the output so far does not follow the grammar", field)
    drafts = row.draft_token_ids.tolist()
    bitmask = allocate_token_bitmask(len(drafts) + 1 + max_forced, verifier.vocab_size)
    fill_next_token_bitmask(matcher.matcher, bitmask, 0)
    filled = 1
    while filled <= len(drafts) and matcher.advance(drafts[filled - 1:filled]):
        fill_next_token_bitmask(matcher.matcher, bitmask, filled)
        filled += 1
    forced: list[int] = []
    if filled == len(drafts) + 1 and max_forced:
        for token in matcher.forced()[:max_forced]:
            if not matcher.advance([token]):
                break
            forced.append(token)
            fill_next_token_bitmask(matcher.matcher, bitmask, filled)
            filled += 1
    matcher.back(filled - 1)
    bitmask[filled:len(drafts) + 1] = bitmask[filled - 1]  # after a refused draft: never emitted
    allowed = unpack(bitmask[:len(drafts) + 1 + len(forced)], verifier.vocab_size)
    if not bool(allowed[:filled].any(-1).all()):
        raise SpecbusError(ErrorCode.invalid_field, "the grammar allows no token here", field)
    return matcher, forced, allowed


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits (T, V) with the tokens outside allowed (T, V) bool at -inf."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
