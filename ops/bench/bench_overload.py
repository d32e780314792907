"""Serving under load: N chat requests at once through an OpenAI-compatible server (the gateway of
`specbus up`) with the official `openai` SDK, streaming. Counts the requests that complete, those
refused with 429 (and whether each 429 said Retry-After) and those that fail otherwise (by
status or exception), with time to first token and inter-token latency (p50 / p99) of the
completed ones, and how long the refusals took.

    specbus up --port 0 --http-port 18000 --log-dir /tmp/overload-stack &
    PYTHONPATH=. .venv/bin/python ops/bench/bench_overload.py -n 64      # then -n 200

The server and key come from --base-url / --api-key, else from the newest client.env of
`specbus up` (OPENAI_BASE_URL, OPENAI_API_KEY). Every request: one user message (--prompt),
exactly --max-tokens tokens (ignore_eos), greedy, sent together; the SDK retries nothing
(max_retries=0), so a 429 is counted, not waited out. ITL is the gap before each content chunk
after the first (a chunk may carry several tokens), as `specbus bench serve` counts it.
Prints the figures and writes --out (JSON) when given.

With --background B, B streams of the same prompt decode first (up to --background-tokens,
cancelled when the burst is over): once each has sent --quiet-chunks chunks after its first, the
gaps between their chunks so far are the decoding rows' ITL without the burst; the gaps that end
while the burst runs (from its send to its last answer) are their ITL during it; the ratio of the
two p99s is printed: how much a burst slows the rows already decoding.
"""

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

from services.commands.bench_serve_core import Distribution, find_client_env
from services.runtime.auth import read_env_file

PROMPT = "Write a short story about a robot who learns to paint, in three sentences."


@dataclass
class Outcome:
    """One request: `done`, `refused` (429) or `error`; times in seconds from the send."""

    kind: str
    seconds: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    why: str = ""  # an error's status or exception name; a refusal's Retry-After ("" when absent)


async def one(api: openai.AsyncOpenAI, model: str, args: argparse.Namespace) -> Outcome:
    sent = time.monotonic()
    arrivals = []
    try:
        stream = await api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic() - sent)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIStatusError as exc:
        seconds = time.monotonic() - sent
        if exc.status_code == 429:
            return Outcome("refused", seconds, why=exc.response.headers.get("retry-after", ""))
        return Outcome("error", seconds, why=str(exc.status_code))
    except openai.APIError as exc:
        return Outcome("error", time.monotonic() - sent, why=type(exc).__name__)
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    return Outcome("done", time.monotonic() - sent, arrivals[0] if arrivals else None, gaps, tokens)


async def background(api: openai.AsyncOpenAI, model: str, args: argparse.Namespace, arrivals: list[float],
                     stop: asyncio.Event) -> None:
    """One decoding stream until stop is set (or its tokens end): each content chunk's monotonic
    arrival time appended to arrivals."""
    stream = await api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.background_tokens,
        temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    try:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
            if stop.is_set():
                break
    finally:
        await stream.close()  # the gateway cancels the request


def gaps_ending(streams: list[list[float]], start: float, end: float) -> list[float]:
    """The gaps between consecutive chunks of each stream whose later chunk came in (start, end]."""
    return [later - earlier for arrivals in streams for earlier, later in zip(arrivals, arrivals[1:])
            if start < later <= end]


async def with_background(api: openai.AsyncOpenAI, model: str, args: argparse.Namespace) -> tuple[list[Outcome], dict]:
    """The burst sent while args.background streams decode (module docstring): its outcomes, and
    the streams' ITL without and during it."""
    streams: list[list[float]] = [[] for _ in range(args.background)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(background(api, model, args, arrivals, stop)) for arrivals in streams]
    while min(map(len, streams)) < 1:  # every stream decoding
        await asyncio.sleep(0.05)
    quiet_from = time.monotonic()
    while min(len([t for t in arrivals if t > quiet_from]) for arrivals in streams) < args.quiet_chunks:
        await asyncio.sleep(0.05)
        if any(task.done() for task in tasks):
            raise SystemExit("a background stream ended before the burst: raise --background-tokens")
    burst_from = time.monotonic()
    outcomes = await asyncio.gather(*(one(api, model, args) for _ in range(args.requests)))
    burst_to = time.monotonic()
    ended_early = sum(task.done() for task in tasks)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    without = Distribution.of(gaps_ending(streams, quiet_from, burst_from))
    during = Distribution.of(gaps_ending(streams, burst_from, burst_to))
    return outcomes, {
        "background_streams": args.background, "background_ended_during_burst": ended_early,
        "background_itl_without_ms": {"p50": round(without.median, 1), "p99": round(without.percentiles[99], 1)},
        "background_itl_during_ms": {"p50": round(during.median, 1), "p99": round(during.percentiles[99], 1)},
        "background_itl_p99_ratio": round(during.percentiles[99] / without.percentiles[99], 2)
        if without.percentiles[99] else None}


def summary(outcomes: list[Outcome], wall_s: float) -> dict:
    done = [o for o in outcomes if o.kind == "done"]
    refused = [o for o in outcomes if o.kind == "refused"]
    distributions = {
        "ttft": Distribution.of([o.ttft_s for o in done if o.ttft_s is not None]),
        "itl": Distribution.of([gap for o in done for gap in o.itl_s]),
        "refusal": Distribution.of([o.seconds for o in refused]),
        "e2e": Distribution.of([o.seconds for o in done]),
    }
    return {"requests": len(outcomes), "completed": len(done), "refused_429": len(refused),
            "refused_without_retry_after": sum(not o.why for o in refused),
            "errors": dict(Counter(o.why for o in outcomes if o.kind == "error")),
            "completion_tokens": sum(o.tokens for o in done), "wall_s": round(wall_s, 2),
            **{f"{name}_ms": {"p50": round(d.median, 1), "p99": round(d.percentiles[99], 1)}
               for name, d in distributions.items()}}


def connection(args: argparse.Namespace) -> tuple[str, str]:
    base_url, api_key = args.base_url, args.api_key
    if base_url is None or api_key is None:
        env_file = find_client_env()
        env = read_env_file(env_file) if env_file else {}
        base_url, api_key = base_url or env.get("OPENAI_BASE_URL"), api_key or env.get("OPENAI_API_KEY", "none")
    if base_url is None:
        raise SystemExit("no server: give --base-url, or run `specbus up` (its client.env names one)")
    return base_url, api_key


async def main(args: argparse.Namespace) -> dict:
    base_url, api_key = connection(args)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                  timeout=args.timeout_s) as api:
        model = args.model or (await api.models.list()).data[0].id
        started = time.monotonic()
        if args.background:
            outcomes, decoding = await with_background(api, model, args)
        else:
            outcomes, decoding = await asyncio.gather(*(one(api, model, args) for _ in range(args.requests))), {}
        result = summary(outcomes, time.monotonic() - started) | decoding
    result |= {"model": model, "max_tokens": args.max_tokens, "base_url": base_url}
    for key, value in result.items():
        print(f"{key:>30}: {value}")
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "outcomes": [asdict(o) for o in outcomes]}, indent=1))
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("-n", "--requests", type=int, default=64, help="requests sent at once (default 64)")
    parser.add_argument("--max-tokens", type=int, default=30, help="completion tokens per request (default 30)")
    parser.add_argument("--prompt", default=PROMPT, help="the user message")
    parser.add_argument("--base-url", help="e.g. http://127.0.0.1:8000/v1 (default: client.env's OPENAI_BASE_URL)")
    parser.add_argument("--api-key", help="(default: client.env's OPENAI_API_KEY)")
    parser.add_argument("--model", help="(default: the first of /v1/models)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="the SDK's per-request timeout")
    parser.add_argument("--out", help="write the figures and every outcome here (JSON)")
    parser.add_argument("--background", type=int, default=0,
                        help="streams decoding before and during the burst, whose ITL is compared (default 0)")
    parser.add_argument("--background-tokens", type=int, default=1800,
                        help="a background stream's max_tokens; it is cancelled when the burst is over")
    parser.add_argument("--quiet-chunks", type=int, default=30,
                        help="chunks each background stream sends before the burst (the ITL without it)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
