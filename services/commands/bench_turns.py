"""`specbus bench serve`'s two other modes, beside its Poisson stream of single prompts.

Multi-turn (`--multi-turn`): held-out ShareGPT conversations with at least two human turns, each
sent turn by turn in order, the model's own earlier answers as the assistant turns of the
history (as a chat client does), --max-concurrency conversations at once. Reported by turn: the
requests, their mean and median TTFT, the prompt tokens and the cached ones
(`usage.prompt_tokens_details.cached_tokens`), and the mean TTFT of every turn after the first;
an outputs digest (sha256 of every answer, in conversation and turn order) tells two runs' outputs
apart, e.g. with the server's prefix caching on and off.

Overload (`--overload N`): N requests sent at once, no cap: how many completed, how many were
refused with 429, how many failed otherwise (by reason), with the completed ones' TTFT.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import statistics
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.commands.bench_serve_core import BenchError, Encode, RequestResult, SampleRequest

# A user turn longer than this many tokens is cut to it: a conversation's history must stay
# within the server's context for several turns.
MAX_TURN_TOKENS = 256


@dataclass(frozen=True)
class TurnResult:
    conversation: int
    turn: int  # 1 for the first
    result: RequestResult


def human_turns(conversation: dict) -> list[str]:
    """The texts of a ShareGPT conversation's human turns, in order (empty ones left out)."""
    return [turn.get("value", "") for turn in conversation.get("conversations") or []
            if turn.get("from") == "human" and turn.get("value", "").strip()]


def sample_conversations(conversations: Sequence[dict], encode: Encode, num: int, seed: int, max_turns: int,
                         output_len: int) -> list[list[SampleRequest]]:
    """num conversations of 2..max_turns user turns (each cut to MAX_TURN_TOKENS tokens), from the
    conversations shuffled with seed; every turn asks output_len tokens."""
    if max_turns < 2:
        raise BenchError("--max-turns must be at least 2")
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    chosen: list[list[SampleRequest]] = []
    for index in order:
        if len(chosen) == num:
            break
        texts = human_turns(conversations[index])[:max_turns]
        if len(texts) < 2:
            continue
        turns = []
        for text in texts:
            ids = encode(text)
            if len(ids) > MAX_TURN_TOKENS:
                text = text[:len(text) * MAX_TURN_TOKENS // len(ids)]
            turns.append(SampleRequest(text, min(len(ids), MAX_TURN_TOKENS), output_len))
        chosen.append(turns)
    if len(chosen) < num:
        raise BenchError(f"only {len(chosen)} held-out ShareGPT conversations have two human turns; asked for {num}")
    return chosen


async def run_conversations(conversations: Sequence[list[SampleRequest]], max_concurrency: int | None,
                            send: Callable[[SampleRequest], Awaitable[RequestResult]]) -> list[TurnResult]:
    """Each conversation's turns in order, the answers so far as its history; at most
    max_concurrency conversations at once. A failed turn ends its conversation."""
    limit = asyncio.Semaphore(max_concurrency or len(conversations))

    async def converse(index: int, turns: list[SampleRequest]) -> list[TurnResult]:
        history: list[dict[str, str]] = []
        out = []
        async with limit:
            for number, turn in enumerate(turns, 1):
                result = await send(SampleRequest(turn.prompt, turn.prompt_len, turn.output_len, tuple(history)))
                out.append(TurnResult(index, number, result))
                if not result.ok:
                    break
                history += [{"role": "user", "content": turn.prompt}, {"role": "assistant", "content": result.text}]
        return out

    done = await asyncio.gather(*(converse(i, turns) for i, turns in enumerate(conversations)))
    return [turn for conversation in done for turn in conversation]


def mean_ms(values: Sequence[float]) -> float:
    return 1000 * statistics.fmean(values) if values else 0.0


def turn_summary(results: Sequence[TurnResult]) -> dict[str, Any]:
    """By turn: requests, failed, TTFT mean / median (ms), mean prompt and cached tokens; the mean
    TTFT of turns >= 2; the outputs digest."""
    by_turn: dict[int, list[RequestResult]] = {}
    for turn in results:
        by_turn.setdefault(turn.turn, []).append(turn.result)
    turns = []
    for number in sorted(by_turn):
        ok = [r for r in by_turn[number] if r.ok and r.ttft_s is not None]
        ttfts = [r.ttft_s for r in ok]
        turns.append({"turn": number, "requests": len(by_turn[number]), "failed": len(by_turn[number]) - len(ok),
                      "mean_ttft_ms": mean_ms(ttfts), "median_ttft_ms": 1000 * statistics.median(ttfts) if ttfts else 0.0,
                      "mean_prompt_tokens": statistics.fmean([r.input_len for r in ok]) if ok else 0.0,
                      "mean_cached_tokens": statistics.fmean([r.cached_tokens or 0 for r in ok]) if ok else 0.0})
    later = [t.result.ttft_s for t in results if t.turn >= 2 and t.result.ok and t.result.ttft_s is not None]
    digest = hashlib.sha256()
    for turn in sorted(results, key=lambda t: (t.conversation, t.turn)):
        digest.update(f"{turn.conversation}/{turn.turn}:{turn.result.output_len}:{turn.result.text}\0".encode())
    return {"turns": turns, "mean_ttft_ms_turns_2_on": mean_ms(later), "outputs_sha256": digest.hexdigest(),
            "failed": sum(not t.result.ok for t in results)}


def format_turns(summary: dict[str, Any]) -> str:
    lines = ["{s:{c}^60}".format(s=" Multi-turn Result ", c="="),
             f"{'turn':>4} {'requests':>8} {'failed':>6} {'mean TTFT ms':>13} {'median':>9} {'prompt':>7} {'cached':>7}"]
    for t in summary["turns"]:
        lines.append(f"{t['turn']:>4} {t['requests']:>8} {t['failed']:>6} {t['mean_ttft_ms']:>13.1f} "
                     f"{t['median_ttft_ms']:>9.1f} {t['mean_prompt_tokens']:>7.0f} {t['mean_cached_tokens']:>7.0f}")
    lines.append(f"Mean TTFT of turns >= 2 (ms): {summary['mean_ttft_ms_turns_2_on']:.1f}")
    lines.append(f"Outputs sha256: {summary['outputs_sha256']}")
    return "\n".join(lines + ["=" * 60])


def overload_counts(results: Sequence[RequestResult]) -> dict[str, Any]:
    """completed, refused (429) and errors by reason, of requests sent at once."""
    refused = [r for r in results if r.failure is not None and r.failure.status == 429]
    errors = Counter(r.failure.key for r in results if r.failure is not None and r.failure.status != 429)
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    return {"sent": len(results), "completed": sum(r.ok for r in results), "refused_429": len(refused),
            "errors": sum(errors.values()), "errors_by_reason": dict(errors), "mean_ttft_ms": mean_ms(ttfts)}


def format_overload(counts: dict[str, Any]) -> str:
    reasons = ", ".join(f"{key} x{n}" for key, n in counts["errors_by_reason"].items()) or "none"
    return (f"overload: {counts['sent']} at once: {counts['completed']} completed, {counts['refused_429']} "
            f"refused 429, {counts['errors']} errors ({reasons}); completed mean TTFT {counts['mean_ttft_ms']:.1f} ms")
