"""Structured outputs in the verifier (docs/PROTOCOL.md#structured-outputs): the grammar's
allowed tokens at every verified position of a row, and the forced tokens it adds as drafts.

A row with `sampling.structured_outputs` keeps an OutputMatcher in its slot, brought each step
to the state after the row's output so far (the tokens after prompt_len, from the slot and
new_token_ids; a migration or resync rebuilds it from them, as the KV cache). Then, for
verified positions t = 0..k: allowed[t] = the tokens the grammar permits after the output and
drafts 0..t-1, the mask the target's law at t is restricted to (`mask_logits`, before
logit_bias and penalties, as vLLM applies its grammar bitmask). A draft the grammar refuses has
target probability 0, so it is rejected whatever the sampling; positions after it are never
emitted and repeat its mask. A row whose proposal is a point mass, or that is Gumbel-coupled,
drops its drafts from the first refused one instead (`row_grammar`'s replace). When every draft
kept is allowed, the tokens the grammar then forces (`OutputMatcher.forced`, up to the row's
max_forced plus the dropped drafts' positions) are appended as point-mass drafts: the target
computes their KV and logprobs like any draft, and under the masked law a token that is the
only one allowed is accepted with probability 1. The matcher is rolled back to the output
afterwards; the next step's `follow` takes whatever was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from gpu_worker.batching.grammar_masks import grammars_of, unpack
from schemas.errors import ErrorCode, SpecbusError
from schemas.steps import VerifyRow
from text.grammar import FIELD, OutputMatcher


@dataclass
class GrammarStep:
    """A row's step under its grammar: its matcher (at the output, after the step too), how many
    of its drafts it keeps (`kept`: all, or for a row that may replace drafts those before the
    first the grammar refuses), the forced tokens that follow them and allowed (kept + #forced
    + 1, V) bool, or (k + 1, V) when all drafts are kept and none is forced."""

    matcher: OutputMatcher
    kept: int
    forced: list[int]
    allowed: torch.Tensor


def row_grammar(verifier, row: VerifyRow, matcher: OutputMatcher | None, output: list[int], prefix: str,
                max_forced: int, replace: bool) -> GrammarStep:
    """The row's step under its grammar (GrammarStep): its matcher is matcher or a fresh one;
    output: the row's output tokens before its first verified position; at most max_forced
    forced tokens after all its drafts. replace: the row's proposal is a point mass or it is
    Gumbel-coupled, so its drafts from the first one the grammar refuses may give way to the
    forced tokens after the ones before (a proposal decided from the history alone keeps any
    acceptance rule exact; a sampled draft's law would not survive that choice). SpecbusError
    naming the field (`{prefix}.sampling.structured_outputs`) when the grammar does not compile,
    the output breaks it, it allows nothing or the matcher fails (its work past LIMITS): the
    row's own failure, never its batch's."""
    try:
        return grammar_step(verifier, row, matcher, output, max_forced, replace)
    except SpecbusError as exc:
        raise SpecbusError(exc.code, exc.message, f"{prefix}.{FIELD}") from None


def grammar_step(verifier, row: VerifyRow, matcher: OutputMatcher | None, output: list[int], max_forced: int,
                 replace: bool) -> GrammarStep:
    """row_grammar's work; its SpecbusErrors name FIELD alone."""
    spec = row.sampling.structured_outputs
    matcher = matcher or OutputMatcher(grammars_of(verifier, verifier.vocab_size).matcher(spec))
    if not matcher.follow(output):
        raise SpecbusError(ErrorCode.invalid_field, "the output so far does not follow the grammar", FIELD)
    drafts = row.draft_token_ids.tolist()
    bitmask = allocate_token_bitmask(len(drafts) + 1 + max_forced, verifier.vocab_size)
    fill_next_token_bitmask(matcher.matcher, bitmask, 0)
    filled = 1
    while filled <= len(drafts) and matcher.advance(drafts[filled - 1:filled]):
        fill_next_token_bitmask(matcher.matcher, bitmask, filled)
        filled += 1
    forced: list[int] = []
    kept = filled - 1
    if kept < len(drafts) and replace:  # the refused drafts' positions go to forced tokens
        max_forced, drafts = max_forced + len(drafts) - kept, drafts[:kept]
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
    if not allowed.numpy()[:filled].any(-1).all():
        raise SpecbusError(ErrorCode.invalid_field, "the grammar allows no token here", FIELD)
    return GrammarStep(matcher, len(drafts), forced, allowed)
