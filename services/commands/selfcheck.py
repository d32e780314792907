"""`specbus selfcheck`: check, on a running deployment and through the public client only, that
speculation changes nothing about what the target model would produce.

    specbus selfcheck --url nats://127.0.0.1:4222 [--quick] [--json] [--prompts FILE]
    specbus selfcheck --local [--quick]      # start a stack (default models), check it, stop it

Checks, one row each in the report (services/commands/selfcheck_core.py holds the statistics):

1. greedy identity: every prompt (built in, plus --prompts) greedy with k = 0, 2, 4, 8
   speculative tokens gives the same token ids as k = 0.
2. distribution: M seeded samples per cell (context x temperature 0.7 / 1.0 x draft mode greedy /
   sample, top-p 0.9, k = 4, `coupling: "rejection"`: the sampler whose draws the drafts shape;
   the default Gumbel coupling's are those of k = 0: the coupling check) against the target's
   exact distribution after the sampling transforms, from scoring requests (processed prompt
   logprobs, top-20 plus every sampled token's own). Positions: completion token 0 is drawn by the target alone (the prefill step
   proposes no drafts); token 1 is the first one that went through the rejection sampler, and
   token 2 the second, drawn either after an accepted first draft or, when the first was
   rejected, in the next step. A token is a sample from the target's distribution given the
   tokens before it, so samples are grouped by their prefix (the earlier completion tokens):
   within a group they are independent draws from one exact distribution (one scoring request
   over context + prefix gives it), and the G statistics of the groups add up (groups of fewer
   than MIN_GROUP samples are left out; that choice depends on the prefixes only, never on the
   tested token). Bins: the top-20 tokens and the rest, merged below 5 expected samples. A
   sampled token outside the candidate set (processed logprob -inf) fails its cell outright.
   Bonferroni across the cells; the family-wise false-failure rate is --alpha.
   Contexts are picked from the built-in prompts by their exact distributions only (before any
   sample is drawn): the first token likely to be one token (so most samples share a prefix) and
   the next one uncertain (where a biased verifier shows).
   Power: the same test on samples simulated, in-process, from a verifier with the same-token
   bypass (accept a draft whenever the target's own sample equals it), same groups, same M, same
   Bonferroni factor, for the greedy-draft cells: there the proposal is a point mass at the
   drafter's token, which the samples show (the accepted from_draft token of the group; the
   target's likeliest token when none was accepted). Sampled drafts come from a distribution the
   public API does not show, so their cells are not simulated. At position 2 the simulation biases
   each group alone, which is close to, not exactly, what the bypass does over a whole step. The
   power row passes when that biased verifier would fail the check.
3. logprob identity: logprobs of speculative completions (chosen token, top-5, requested ids;
   raw and processed; greedy and sampled) against a scoring request over prompt + completion,
   position by position: bit for bit (LOGPROB_TOLERANCE = 0: the forward gives a position the
   same logits in a verify step as in a prefill, docs/PROTOCOL.md#bitwise-guarantee).
4. seed reproducibility: one seeded sampled request (rejection-sampled, as in check 2) alone
   twice, then among concurrent requests (another batch composition): the same tokens. A run flagged degraded (e.g. a late drafter
   makes a step run with k = 0, which takes another path through the seeds) is run again, and
   left uncompared if it stays degraded.
5. degradation honesty: over every request the checks ran to its end (the distribution samples are
   cancelled after their third token, so they have no usage), each degraded reason on a chunk is
   counted in the final usage.degraded_steps at least as many times as chunks carry it.

--quick sends about 500 requests, 400 of them distribution samples (M = 100 per cell, where the
power row passes on both shipped pairs); the full run draws M = 800 over two contexts and checks
more prompts. Both say on stderr, one line each, when a check starts and how it ended, and show
a progress bar on a terminal. How long a run takes depends on the pair and the machine
(ops/bench/RESULTS.md has measured runs).

--local runs its scheduler with a 5 s draft timeout (unless SPECBUS_DRAFT_TIMEOUT_S is set): on a
busy small machine the default 0.5 s turns steps into k = 0, and a check of speculation would then
check little speculation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from schemas.config import ENV_PREFIX, BusConfig, load_config
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import GenerateRequest, new_request_id
from schemas.bus.protocol import MAX_LOGPROB_TOKEN_IDS, MAX_TOP_LOGPROBS
from schemas.streams import TokenLogprob, Usage
from services.client import Client, GenerationResult, Overloaded, make_request, score_request
from services.commands.selfcheck_core import (
    ALPHA,
    CheckResult,
    LogprobEntry,
    bin_counts,
    distribution_bins,
    distribution_results,
    format_p,
    logprob_diffs,
    pooled_gof,
    render_details,
    render_table,
    report_json,
    same_token_bypass,
)
from services.launch.up import add_stack_arguments, print_error, stack_config, start_stack
from services.runtime.tasks import shutdown_event, until_stopped

BUILTIN_PROMPTS = (
    "def fibonacci(n):\n    ",
    'import os\nimport sys\n\n\ndef main(argv=None):\n    """',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "The capital of France is",
    "for i in range(len(items)):\n    if items[i]",
    "Once upon a time, there was a",
    "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n",
    "Here is a list of three fruits:\n1.",
)
CHECKS = ("greedy", "distribution", "logprobs", "seeds", "coupling", "degradation")
GREEDY_KS = (0, 2, 4, 8)
DIST_TEMPERATURES = (0.7, 1.0)
DIST_DRAFT_MODES = ("greedy", "sample")
DIST_TOP_P = 0.9
DIST_K = 4
DIST_POSITIONS = (0, 1, 2)
# The first decode step gets all DIST_K drafts (the scheduler caps them by the tokens left); only
# the first len(DIST_POSITIONS) tokens are read, then the request is cancelled.
DIST_MAX_TOKENS = 1 + DIST_K + 1
MIN_GROUP = 10  # samples sharing a prefix needed to test it
SEED_BASE = 1_000_003
LOGPROB_TOLERANCE = 0.0  # exact: a batch-invariant forward, in every dtype
LOGPROB_TOP_N = 5
SEED_RETRIES = 2  # extra runs allowed when a reproducibility run comes back degraded
OVERLOAD_RETRIES = 8
REQUEST_TIMEOUT_S = 300.0
# Between two chunks of one request (the client's default is 30 s): 32 requests in flight on a
# loaded small CPU can stall a step that long, and a stalled request is not what is checked.
IDLE_TIMEOUT_S = 120.0
LOCAL_DRAFT_TIMEOUT_S = "5"  # --local's scheduler (module docstring)


@dataclass(frozen=True)
class CheckPlan:
    """How much each check does. greedy_prompts: built-in prompts for greedy identity (every
    --prompts one is added); samples: M per distribution cell."""

    greedy_prompts: int
    greedy_tokens: int
    samples: int
    contexts: int
    logprob_prompts: int
    logprob_tokens: int
    seed_tokens: int
    seed_draft_modes: int


QUICK = CheckPlan(greedy_prompts=3, greedy_tokens=16, samples=100, contexts=1, logprob_prompts=1, logprob_tokens=12,
             seed_tokens=16, seed_draft_modes=1)
FULL = CheckPlan(greedy_prompts=len(BUILTIN_PROMPTS), greedy_tokens=64, samples=800, contexts=2, logprob_prompts=3,
            logprob_tokens=48, seed_tokens=64, seed_draft_modes=2)


# ---------------------------------------------------------------------------------------------
# sending requests


@dataclass
class Audit:
    """What degradation honesty needs from one request: chunks flagged per reason, final usage."""

    request_id: str
    flagged_chunks: Counter
    usage: Usage | None


@dataclass
class Runner:
    """Sends requests with a bounded number in flight, retries `overloaded`, counts progress
    and keeps an Audit of every request."""

    client: Client
    concurrency: int
    progress: tqdm
    audits: list[Audit] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.concurrency)

    async def generate(self, request: GenerateRequest, num_tokens: int | None = None) -> GenerationResult:
        """The request's result; with num_tokens, only its first num_tokens tokens (the request
        is cancelled once they came, so it has no usage and no audit)."""
        async with self.slots:
            for attempt in range(OVERLOAD_RETRIES + 1):
                try:
                    result = await self.collect(request, num_tokens)
                    break
                except Overloaded:
                    if attempt == OVERLOAD_RETRIES:
                        raise
                    await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
                    request = request.model_copy(update={"request_id": new_request_id()})
        self.progress.update(1)
        return result

    async def collect(self, request: GenerateRequest, num_tokens: int | None) -> GenerationResult:
        result = GenerationResult(request.request_id, requested_ids=request.logprobs.logprob_token_ids.tolist())
        flagged: Counter = Counter()
        async with contextlib.aclosing(self.client.stream(request)) as chunks:
            async for chunk in chunks:
                result.add(chunk)
                flagged.update(set(chunk.degraded))
                if num_tokens is not None and len(result.token_ids) >= num_tokens and not chunk.final:
                    return result  # closing the stream cancels the request
        self.audits.append(Audit(request.request_id, flagged, result.usage))
        return result

    async def generate_all(self, requests: Sequence[GenerateRequest],
                           num_tokens: int | None = None) -> list[GenerationResult]:
        self.progress.total = (self.progress.total or 0) + len(requests)
        self.progress.refresh()
        return list(await asyncio.gather(*(self.generate(request, num_tokens) for request in requests)))


def request(prompt: str | Sequence[int], **options) -> GenerateRequest:
    return make_request(prompt, timeout_s=REQUEST_TIMEOUT_S, **options)


# ---------------------------------------------------------------------------------------------
# 1. greedy identity


async def check_greedy(runner: Runner, prompts: Sequence[str], plan: CheckPlan) -> CheckResult:
    requests = [request(prompt, max_tokens=plan.greedy_tokens, temperature=0.0, ignore_eos=True,
                        num_speculative_tokens=k) for prompt in prompts for k in GREEDY_KS]
    results = iter(await runner.generate_all(requests))
    details, num_differ, accepted = [], 0, 0
    for index, prompt in enumerate(prompts):
        by_k = {k: next(results) for k in GREEDY_KS}
        plain = by_k[0].token_ids
        for k in GREEDY_KS[1:]:
            tokens = by_k[k].token_ids
            first = next((i for i, (a, b) in enumerate(zip(plain, tokens)) if a != b),
                         None if len(plain) == len(tokens) else min(len(plain), len(tokens)))
            num_differ += first is not None
            accepted += by_k[k].usage.draft_tokens_accepted
            details.append({"prompt": index, "k": k, "tokens": len(tokens), "identical": first is None,
                            "first_difference": first, "draft_accepted": by_k[k].usage.draft_tokens_accepted})
    cells = len(details)
    notes = [f"prompt {d['prompt']}, k={d['k']}: differs from k=0 at token {d['first_difference']}"
             for d in details if not d["identical"]]
    if not accepted:
        notes.append("no draft token was accepted: speculation was not exercised")
    return CheckResult("greedy identity", cells, f"{cells - num_differ}/{cells} identical to k=0", "-",
                       num_differ == 0, details, notes)


# ---------------------------------------------------------------------------------------------
# 2. distribution


@dataclass
class NextToken:
    """The exact distribution after a prefix: top ids and probs as `distribution_bins` gives
    them (probs has the rest last), and the processed logprob of each requested id."""

    ids: list[int]
    probs: np.ndarray
    requested: dict[int, float]


def scored_entry(result: GenerationResult, position: int) -> TokenLogprob:
    """The prompt logprobs of a scoring request at position; a SpecbusError when they did not
    come (the side channel was late: the chunk is flagged degraded)."""
    entry = None if result.prompt_logprobs is None else result.prompt_logprobs[position]
    if entry is None:
        raise SpecbusError(ErrorCode.internal, f"scoring request {result.request_id} came back without prompt "
                                               f"logprobs (degraded: {', '.join(result.degraded) or 'none'})")
    return entry


async def next_token(runner: Runner, prefix: Sequence[int], temperature: float,
                     extra_ids: Sequence[int] = ()) -> NextToken:
    """A scoring request over prefix + one token: its last prompt-logprobs entry is the
    processed distribution of the token after prefix (top-20, and extra_ids' own logprobs,
    MAX_LOGPROB_TOKEN_IDS per request)."""
    extra_ids = sorted(set(extra_ids))
    chunks = [extra_ids[i:i + MAX_LOGPROB_TOKEN_IDS] for i in range(0, len(extra_ids), MAX_LOGPROB_TOKEN_IDS)] or [[]]
    sequence = [*prefix, prefix[-1]]  # any token does: only the distribution before it is read
    results = await runner.generate_all([
        score_request(sequence, prompt_logprobs=MAX_TOP_LOGPROBS, logprobs_mode="processed", temperature=temperature,
                      top_p=DIST_TOP_P, logprob_token_ids=chunk or None, timeout_s=REQUEST_TIMEOUT_S)
        for chunk in chunks])
    entries = [scored_entry(result, len(prefix)) for result in results]
    requested: dict[int, float] = {}
    for chunk, entry in zip(chunks, entries):
        requested |= dict(zip(chunk, entry.requested_logprobs.tolist()))
    entry = entries[0]
    ids, probs = distribution_bins(entry.top_ids.tolist(), entry.top_logprobs.tolist())
    return NextToken(ids, probs, requested)


async def pick_contexts(runner: Runner, count: int) -> dict[int, list[int]]:
    """The `count` built-in prompts (index -> token ids) whose exact distributions promise the
    most informative samples at temperature 0.7: q0(t0*) * q1max * (1 - q1max), t0* the likeliest
    first token and q1max the largest probability of the token after it. Uses no sample."""
    scored = await runner.generate_all([score_request(p, prompt_logprobs=0, timeout_s=REQUEST_TIMEOUT_S)
                                        for p in BUILTIN_PROMPTS])
    contexts = [result.prompt_token_ids for result in scored]
    firsts = await asyncio.gather(*(next_token(runner, ctx, DIST_TEMPERATURES[0]) for ctx in contexts))
    seconds = await asyncio.gather(*(next_token(runner, [*ctx, first.ids[0]], DIST_TEMPERATURES[0])
                                     for ctx, first in zip(contexts, firsts)))
    scores = [first.probs[0] * second.probs[0] * (1 - second.probs[0]) for first, second in zip(firsts, seconds)]
    order = sorted(range(len(contexts)), key=lambda i: -scores[i])
    return {i: contexts[i] for i in order[:count]}


@dataclass
class Cell:
    context: int  # index in BUILTIN_PROMPTS
    temperature: float
    draft_mode: str
    position: int
    groups: dict[tuple[int, ...], list[int]]  # prefix -> the tokens sampled after it


async def check_distribution(runner: Runner, plan: CheckPlan, alpha: float) -> list[CheckResult]:
    """The distribution row and the power row (module docstring, check 2)."""
    contexts = await pick_contexts(runner, plan.contexts)
    keys = [(c, t, mode) for c in contexts for t in DIST_TEMPERATURES for mode in DIST_DRAFT_MODES]
    samples = await runner.generate_all([
        request(contexts[c], max_tokens=DIST_MAX_TOKENS, temperature=t, top_p=DIST_TOP_P, seed=SEED_BASE + i,
                ignore_eos=True, num_speculative_tokens=DIST_K, draft_mode=mode, coupling="rejection")
        for c, t, mode in keys for i in range(plan.samples)], num_tokens=len(DIST_POSITIONS))
    by_key = {key: samples[i * plan.samples:(i + 1) * plan.samples] for i, key in enumerate(keys)}
    cells, drafts = [], defaultdict(Counter)  # (context, temperature, prefix) -> accepted greedy drafts
    for (c, t, mode), results in by_key.items():
        # token 0 comes from the target alone, the same draw in either draft mode: tested once
        for position in DIST_POSITIONS[mode != DIST_DRAFT_MODES[0]:]:
            groups = defaultdict(list)
            for result in results:
                if len(result.token_ids) > position:
                    prefix = tuple(result.token_ids[:position])
                    groups[prefix].append(result.token_ids[position])
                    if mode == "greedy" and result.from_draft[position]:
                        drafts[c, t, prefix][result.token_ids[position]] += 1
            cells.append(Cell(c, t, mode, position, {p: tokens for p, tokens in groups.items()
                                                     if len(tokens) >= MIN_GROUP}))
    wanted = defaultdict(set)  # (context, temperature, prefix) -> tokens whose logprob to check
    for cell in cells:
        for prefix, tokens in cell.groups.items():
            wanted[cell.context, cell.temperature, prefix] |= set(tokens)
    exact = dict(zip(wanted, await asyncio.gather(*(
        next_token(runner, [*contexts[c], *prefix], t, tokens) for (c, t, prefix), tokens in wanted.items()))))

    degraded = {key: sum(bool(r.degraded) for r in results) for key, results in by_key.items()}
    rng = np.random.default_rng(SEED_BASE)
    details = [{**cell_row(cell, exact, drafts, rng),
                "degraded_samples": degraded[cell.context, cell.temperature, cell.draft_mode]} for cell in cells]
    return distribution_results(details, alpha, plan.samples)


def cell_row(cell: Cell, exact: dict, drafts: dict, rng: np.random.Generator) -> dict:
    """One cell's test against the exact distributions (exact[(context, temperature, prefix)]),
    and, for greedy drafts past token 0, the same test on samples simulated from the same-token
    bypass with the group's draft token (drafts[(context, temperature, prefix)]: the accepted
    greedy drafts seen there)."""
    groups, biased, outside = [], [], 0
    for prefix, tokens in cell.groups.items():
        dist = exact[cell.context, cell.temperature, prefix]
        outside += sum(dist.requested.get(token, -math.inf) == -math.inf for token in tokens)
        groups.append((bin_counts(tokens, dist.ids), dist.probs))
        if cell.position > 0 and cell.draft_mode == "greedy":
            accepted = drafts[cell.context, cell.temperature, prefix]
            draft = accepted.most_common(1)[0][0] if accepted else dist.ids[0]
            simulated = same_token_bypass(dist.probs, dist.ids.index(draft) if draft in dist.ids else 0)
            biased.append((rng.multinomial(len(tokens), simulated / simulated.sum()), dist.probs))
    gof = pooled_gof(groups)
    row = {"context": cell.context, "temperature": cell.temperature, "draft_mode": cell.draft_mode,
           "position": cell.position, "samples": gof.num_samples, "groups": gof.num_groups, "dof": gof.dof,
           "G": round(gof.statistic, 2), "p": 0.0 if outside else gof.p_value, "outside_candidates": outside}
    if biased:
        row["bypass_p"] = pooled_gof(biased).p_value
    return row


# ---------------------------------------------------------------------------------------------
# 3. logprob identity


def plain_entry(entry: TokenLogprob, requested: Sequence[float]) -> LogprobEntry:
    return LogprobEntry(entry.token_id, entry.logprob, dict(entry.top), list(requested))


async def check_logprobs(runner: Runner, prompts: Sequence[str], plan: CheckPlan) -> CheckResult:
    """Cells: prompt x mode (raw, processed) x sampling (greedy; T=0.8, top-p 0.9, sampled drafts)."""
    samplings = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_p=0.9, seed=SEED_BASE,
                                                                 draft_mode="sample")}
    prompt_ids = [r.prompt_token_ids for r in await runner.generate_all(
        [score_request(p, prompt_logprobs=0, timeout_s=REQUEST_TIMEOUT_S) for p in prompts])]
    keys = [(i, mode, name) for i in range(len(prompts)) for mode in ("raw", "processed") for name in samplings]
    # ids that exist in any vocabulary: the prompt's own, plus 0
    probes = {i: sorted({0, *ids})[:8] for i, ids in enumerate(prompt_ids)}
    generated = await runner.generate_all([
        request(prompt_ids[i], max_tokens=plan.logprob_tokens, ignore_eos=True, num_speculative_tokens=DIST_K,
                logprobs=LOGPROB_TOP_N, logprobs_mode=mode, logprob_token_ids=probes[i], **samplings[name])
        for i, mode, name in keys])
    scored = await runner.generate_all([
        score_request(prompt_ids[i] + result.token_ids, prompt_logprobs=LOGPROB_TOP_N, logprobs_mode=mode,
                      logprob_token_ids=probes[i], timeout_s=REQUEST_TIMEOUT_S,
                      **{k: v for k, v in samplings[name].items() if k != "draft_mode"})
        for (i, mode, name), result in zip(keys, generated)])
    details, notes, worst, compared, accepted = [], [], 0.0, 0, 0
    for (i, mode, name), result, score in zip(keys, generated, scored):
        offset, cell_worst, problems = len(prompt_ids[i]), 0.0, []
        accepted += sum(result.from_draft)
        for position, entry in enumerate(result.logprobs or [None] * len(result.token_ids)):
            if entry is None:
                problems.append(f"token {position}: no logprobs (degraded: {', '.join(result.degraded) or 'none'})")
                continue
            reference = scored_entry(score, offset + position)
            diff, count, found = logprob_diffs(plain_entry(entry, entry.requested_logprobs.tolist()),
                                               plain_entry(reference, reference.requested_logprobs.tolist()),
                                               LOGPROB_TOLERANCE)
            cell_worst, compared = max(cell_worst, diff), compared + count
            problems += [f"token {position}: {problem}" for problem in found]
        worst = max(worst, cell_worst)
        details.append({"prompt": i, "mode": mode, "sampling": name, "tokens": len(result.token_ids),
                        "from_draft": sum(result.from_draft), "max_diff": cell_worst, "problems": len(problems)})
        notes += [f"prompt {i} {mode} {name}: {problem}" for problem in problems[:3]]
    passed = not any(d["problems"] for d in details)
    if not accepted:
        notes.append("no draft token was accepted: speculation was not exercised")
    return CheckResult("logprob identity", len(details), f"{compared} values compared",
                       f"max diff {worst:.2g}", passed, details, notes)


# ---------------------------------------------------------------------------------------------
# 4. seed reproducibility


async def check_seeds(runner: Runner, prompts: Sequence[str], plan: CheckPlan) -> CheckResult:
    """Per draft mode (sample; also greedy in the full run): a seeded sampled request alone,
    alone again, then among concurrent requests of other lengths, k and temperatures. A run
    flagged degraded is run again (SEED_RETRIES times); a pair still degraded is not compared
    (a k=0 step takes another path through the seeds: a correct sample, not the same one)."""
    subjects = [request(prompts[0], max_tokens=plan.seed_tokens, temperature=1.0, top_p=0.95, seed=SEED_BASE + 7,
                        ignore_eos=True, num_speculative_tokens=DIST_K, draft_mode=mode, coupling="rejection")
                for mode in DIST_DRAFT_MODES[-plan.seed_draft_modes:]]

    async def run(subject: GenerateRequest, with_traffic: bool) -> GenerationResult:
        for _ in range(SEED_RETRIES + 1):
            fresh = subject.model_copy(update={"request_id": new_request_id()})
            if with_traffic:
                traffic = [request(prompt, max_tokens=max(4, plan.seed_tokens - 2 * j), temperature=0.9,
                                   seed=SEED_BASE + j, ignore_eos=True, num_speculative_tokens=(0, 2, 8)[j % 3])
                           for j, prompt in enumerate([*prompts, *prompts][:6])]
                results = await runner.generate_all([*traffic[:3], fresh, *traffic[3:]])
                result = results[3]
            else:
                result = (await runner.generate_all([fresh]))[0]
            if not result.degraded:
                break
        return result

    details, notes = [], []
    for subject in subjects:
        mode = subject.speculative.draft_mode
        reference = await run(subject, False)
        for label, with_traffic in (("alone again", False), ("with concurrent traffic", True)):
            again = await run(subject, with_traffic)
            flagged = sorted({*reference.degraded, *again.degraded})
            outcome = "not compared" if flagged else "identical" if again.token_ids == reference.token_ids \
                else "different"
            details.append({"draft_mode": mode, "run": label, "tokens": len(again.token_ids), "outcome": outcome,
                            "degraded": flagged})
            if outcome != "identical":
                notes.append(f"draft {mode}, {label}: {outcome}" + (f" (degraded: {', '.join(flagged)})"
                                                                     if flagged else ""))
    compared = [d for d in details if d["outcome"] != "not compared"]
    identical = sum(d["outcome"] == "identical" for d in compared)
    if not compared:
        notes.append("every run was degraded (a k=0 step draws along another path): nothing could be compared")
    return CheckResult("seed reproducibility", len(compared), f"{identical}/{len(compared)} identical", "-",
                       bool(compared) and identical == len(compared), details, notes)


async def check_coupling(runner: Runner, prompts: Sequence[str], plan: CheckPlan) -> CheckResult:
    """Drafter-invariant sampling (coupling "gumbel", docs/PROTOCOL.md#drafter-invariant-sampling):
    a seeded sampled request at k=0, then at k=4 and k=8 (draft modes sample and greedy), and at
    k=4 among concurrent traffic, must give the same tokens. No run is exempt when degraded: a late
    or dead drafter changes nothing under this coupling."""
    def subject(k: int, mode: str = "sample") -> GenerateRequest:
        return request(prompts[0], max_tokens=plan.seed_tokens, temperature=1.0, top_p=0.95, seed=SEED_BASE + 11,
                       ignore_eos=True, num_speculative_tokens=k, draft_mode=mode, coupling="gumbel")

    [reference] = await runner.generate_all([subject(0)])
    runs = {"k=4": [subject(4)], "k=8": [subject(8)], "k=4, draft greedy": [subject(4, "greedy")]}
    traffic = [request(prompt, max_tokens=max(4, plan.seed_tokens - 2 * j), temperature=0.9, seed=SEED_BASE + j,
                       ignore_eos=True, num_speculative_tokens=(0, 2, 8)[j % 3])
               for j, prompt in enumerate([*prompts, *prompts][:4])]
    runs["k=4 with concurrent traffic"] = [*traffic[:2], subject(4), *traffic[2:]]
    details, notes = [], []
    for label, batch in runs.items():
        results = await runner.generate_all(batch)
        result = results[0] if len(batch) == 1 else results[2]
        same = result.token_ids == reference.token_ids
        details.append({"run": label, "tokens": len(result.token_ids), "outcome": "identical" if same else "different",
                        "draft_accepted": result.usage.draft_tokens_accepted if result.usage else 0,
                        "degraded": sorted(result.degraded)})
        if not same:
            notes.append(f"{label}: different from k=0")
    identical = sum(d["outcome"] == "identical" for d in details)
    return CheckResult("coupling invariance", len(details), f"{identical}/{len(details)} identical to k=0", "-",
                       identical == len(details), details, notes)


# ---------------------------------------------------------------------------------------------
# 5. degradation honesty


def check_degradation(audits: Sequence[Audit]) -> CheckResult:
    notes, flagged_total, counted = [], 0, 0
    for audit in audits:
        if audit.usage is None:
            notes.append(f"request {audit.request_id}: no final usage")
            continue
        flagged_total += sum(audit.flagged_chunks.values())
        counted += sum(audit.usage.degraded_steps.values())
        for reason, chunks in audit.flagged_chunks.items():
            in_usage = audit.usage.degraded_steps.get(reason, 0)
            if in_usage < chunks:
                notes.append(f"request {audit.request_id}: {chunks} chunks flagged {reason!r}, usage counts {in_usage}")
    return CheckResult("degradation honesty", len(audits),
                       f"{flagged_total} flagged chunks, {counted} degraded steps in usage", "-", not notes, [],
                       notes[:10])


# ---------------------------------------------------------------------------------------------
# running the checks


async def run_checks(client: Client, prompts: Sequence[str], plan: CheckPlan, checks: Sequence[str],
                     alpha: float = ALPHA, concurrency: int = 32) -> list[CheckResult]:
    """The selected checks in order; a check that raises (a request failed) is a failed row.
    Each check says on stderr, one line each, when it starts and how it ended (`announce`)."""
    with tqdm(total=0, unit="req", desc="selfcheck", disable=None, leave=False) as progress:
        runner = Runner(client, concurrency, progress)
        greedy_prompts = [*BUILTIN_PROMPTS[:plan.greedy_prompts], *prompts]
        steps = {
            "greedy": ("greedy identity", lambda: check_greedy(runner, greedy_prompts, plan)),
            "distribution": ("distribution", lambda: check_distribution(runner, plan, alpha)),
            "logprobs": ("logprob identity", lambda: check_logprobs(runner, greedy_prompts[:plan.logprob_prompts],
                                                                    plan)),
            "seeds": ("seed reproducibility", lambda: check_seeds(runner, greedy_prompts, plan)),
            "coupling": ("coupling invariance", lambda: check_coupling(runner, greedy_prompts, plan)),
        }
        results: list[CheckResult] = []
        for name in checks:
            if name not in steps:
                continue
            title, start = steps[name]
            announce(progress, f"{title}: started")
            started = time.perf_counter()
            try:
                outcome = await start()
            except SpecbusError as exc:
                outcome = CheckResult(title, 0, "-", "-", False, notes=[f"a request failed: {exc}"])
            outcome = outcome if isinstance(outcome, list) else [outcome]
            for row in outcome:
                row.seconds = time.perf_counter() - started
            announce(progress, ended(title, outcome))
            results += outcome
        if "degradation" in checks:
            announce(progress, "degradation honesty: started")
            results.append(check_degradation(runner.audits))
            announce(progress, ended("degradation honesty", results[-1:]))
    return results


def announce(progress: tqdm, what: str) -> None:
    """`selfcheck: <what>` as a line on stderr, above the progress bar when there is one."""
    progress.write(f"selfcheck: {what}", file=sys.stderr)
    sys.stderr.flush()


def ended(title: str, rows: Sequence[CheckResult]) -> str:
    """How a check ended: passed when all its rows did, else FAILED; its rows and wall time."""
    verdict = "passed" if all(row.passed for row in rows) else "FAILED"
    return f"{title}: {verdict} ({len(rows)} row{'s' if len(rows) != 1 else ''}, {rows[0].seconds:.1f} s)"


def read_prompts(path: str) -> list[str]:
    """One prompt per non-empty line; a line that is a JSON string is decoded (multi-line
    prompts: "def f():\\n    ")."""
    prompts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                line = json.loads(line)
            except json.JSONDecodeError:
                pass
        prompts.append(line)
    return prompts


def parse_checks(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check {unknown[0] if unknown else text!r}; choose from {CHECKS}")
    return names


def add_selfcheck_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help="NATS url of the deployment (env SPECBUS_NATS_URL; credentials from SPECBUS_NATS_USER "
                             "/ SPECBUS_NATS_PASSWORD as for `specbus generate`)")
    parser.add_argument("--local", action="store_true",
                        help="start a stack on a free port (the stack flags below; a 5 s draft timeout), check it, "
                             "stop it")
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer prompts and samples (M={QUICK.samples}): about 20 s on the tiny pair, 3 min on "
                             "the default pair on a 2-core CPU")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="more prompts for greedy identity: one per line (a JSON string for multi-line ones)")
    parser.add_argument("--samples", type=int, default=None, metavar="M",
                        help=f"samples per distribution cell (default {QUICK.samples} quick, {FULL.samples} full)")
    parser.add_argument("--alpha", type=float, default=ALPHA,
                        help=f"false-failure rate of the distribution check (default {ALPHA})")
    parser.add_argument("--checks", type=parse_checks, default=list(CHECKS),
                        help=f"comma-separated subset of {','.join(CHECKS)} (default: all)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32)")
    add_stack_arguments(parser.add_argument_group("the stack --local starts (--prefix also applies to --url)"))


def print_report(results: Sequence[CheckResult], settings: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report_json(results, settings)), flush=True)
        return
    print(f"specbus selfcheck: {settings['mode']}, M={settings['samples']} samples per distribution cell, "
          f"alpha={settings['alpha']}")
    print(render_table(results))
    distribution = next((r for r in results if r.name == "distribution"), None)
    if distribution is not None and distribution.details:
        print("\ndistribution cells (context: the number of a built-in prompt):")
        rows = [{**d, "p": format_p(d["p"]), "bypass_p": format_p(d.get("bypass_p"))} for d in distribution.details]
        print(render_details(rows, ("context", "temperature", "draft_mode", "position", "samples", "groups", "dof",
                                    "G", "p", "bypass_p")))
    sys.stdout.flush()


async def run_selfcheck_command(args: argparse.Namespace) -> int:
    """Exit 0 when every check passed, 1 when one failed, 2 on bad usage."""
    plan = QUICK if args.quick else FULL
    if args.samples is not None:
        if args.samples < MIN_GROUP:
            print(f"error: --samples must be at least {MIN_GROUP}", file=sys.stderr)
            return 2
        plan = dataclasses.replace(plan, samples=args.samples)
    try:
        prompts = read_prompts(args.prompts) if args.prompts else []
    except OSError as exc:
        print(f"error: --prompts: {exc}", file=sys.stderr)
        return 2
    settings = {"mode": "quick" if args.quick else "full", "samples": plan.samples, "alpha": args.alpha,
                "checks": args.checks, "prompts_from_file": len(prompts)}
    stop = shutdown_event()  # Ctrl-C: the requests in flight are cancelled, a --local stack stopped
    async with contextlib.AsyncExitStack() as exit_stack:
        try:
            if args.local:
                config = stack_config(args, 0)
                if ENV_PREFIX + "DRAFT_TIMEOUT_S" not in os.environ:
                    scheduler_args = [*config.role_args.get("scheduler", []), "--draft-timeout-s",
                                      LOCAL_DRAFT_TIMEOUT_S]
                    config = dataclasses.replace(config, role_args={**config.role_args, "scheduler": scheduler_args})
                with contextlib.redirect_stdout(sys.stderr):  # stdout is the report's (--json)
                    stack = await start_stack(config, stop, exit_stack)
                if stack is None:
                    return 1
                client = await exit_stack.enter_async_context(stack.client(idle_timeout_s=IDLE_TIMEOUT_S))
            else:
                bus = load_config(BusConfig, nats_url=args.url, prefix=args.prefix)
                client = await exit_stack.enter_async_context(Client.from_config(bus, idle_timeout_s=IDLE_TIMEOUT_S))
            checks = asyncio.ensure_future(run_checks(client, prompts, plan, args.checks, args.alpha,
                                                      args.concurrency))
            if not await until_stopped(checks, stop):
                print("interrupted: no report", file=sys.stderr)
                return 130
            results = checks.result()
        except SpecbusError as exc:
            print_error(exc)
            return 1
    print_report(results, settings, args.json)
    return 0 if all(r.passed for r in results) else 1
