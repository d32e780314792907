"""specbus against its peers and against itself, in one run.

    PYTHONPATH=. .venv/bin/python ops/bench/bench_pipeline.py                  # run time: ops/bench/RESULTS.md
    PYTHONPATH=. .venv/bin/python ops/bench/bench_pipeline.py --device cuda    # the same on a GPU

Prints a table per section and writes <results>/results.json, <results>/results.md (the same
tables) and <results>/bench.png, <results> being --results (default
ops/bench/results/<UTC timestamp>/). The model pair is copied first, so a checkpoint written during the run changes nothing. Prompts: --prompt-tokens tokens
from held-out stdlib files (ops/train/train_models.py `source_files()`), or with --chat held-out questions
(ops/train/distill_draft.py, never trained on) in the target's chat template; --prompts of them, each
request generating exactly --max-tokens tokens (ignore_eos; transformers: min_new_tokens).
Sampled runs use --temperature and --top-p.
tokens/s = completion tokens of all requests / wall time of the section's run.

Sections (the stack, the in-process loop and the transformers models are all loaded first, and
runs that are compared are made next to each other in time: the cores are shared, and load
from other processes would otherwise decide the ratios):
1. peer: per prompt, transformers `generate` plain greedy, then assisted greedy (assistant = the
   draft expanded to the target vocabulary by ops/train/export_assistant_draft.py, transformers'
   default assistant settings), then specbus greedy at k=--peer-k, batch 1: tokens/s, ratios.
2. speculation: specbus at k in --ks, batch 1, greedy (temperature 0) and sampled (--temperature,
   draft modes greedy and sample), request i of every configuration before request i+1 of any:
   tokens/s, tokens per target forward (usage.completion_tokens / usage.steps, prefill step
   included) and the ratio to k=0 of the same decoding mode.
3. theory: per decode step the bench knows the drafts planned (min(k, tokens left - 1); 0 when
   the chunk is flagged draft_timeout/resync) and the drafts accepted (the chunk's from_draft
   flags). Draft position i is REACHED in a step when drafts 1..i-1 were accepted; the
   acceptance at position i is a_i = accepted_i / reached_i, and the pooled a = sum accepted /
   sum reached (the maximum-likelihood rate of the i.i.d. model behind the formula). Measured:
   mean tokens emitted per step over steps planned with all k drafts; predicted:
   (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023, eq. 1); their ratio.
4. bus: at each --overhead-batches concurrency, greedy k=--peer-k, the full pipeline
   (services.launch.stack.Stack: nats-server + one process per service), then at once the same requests
   through ops/bench/inprocess.py (one process, direct calls): throughput ratio pipeline /
   in-process, and ms per step: in-process by stage, codec (one msgpack encode + decode of every
   message, timed inside the in-process run and left out of its throughput and ms/step),
   pipeline (wall / scheduler steps from $SRV.STATS.scheduler), bus = pipeline - in-process.
5. scaling: total tokens/s of the pipeline at --scaling-batches concurrent requests (each run has
   max(batch, --prompts) requests, a new one sent as soon as one finishes).
6. kernels: ops/bench/kernels/bench_kernels.py on a small grid (--kernel-batch/-k/-vocab).
"""

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from text.tokenizer import load_tokenizer
from ops.bench.kernels.bench_kernels import bench_one
from ops.bench.inprocess import STAGES, load_inprocess, run_requests
from ops.train.distill_draft import held_out_chat_prompts
from ops.train.export_assistant_draft import check_expanded, export_assistant_draft, load_hf
from ops.train.train_models import read_text, source_files
from schemas.config import DEFAULT_DRAFT, SchedulerConfig, default_target_model
from schemas.streams import StreamChunk
from services.client import Client, make_request
from services.launch.stack import Stack, StackConfig
from services.runtime.logs import configure_logging

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
REQUEST_TIMEOUT_S = 600.0
NO_DRAFT_REASONS = {"draft_timeout", "resync"}


@dataclass(frozen=True)
class Mode:
    """A decoding mode of the speculation section."""

    name: str
    temperature: float
    draft_mode: str
    top_p: float = 1.0


# ---------------------------------------------------------------------------------------------
# prompts and requests


def held_out_prompts(tokenizer_dir, count: int, length: int) -> list[list[int]]:
    """count distinct windows of `length` tokens from held-out stdlib files: first the middle of
    each file, then further windows of the longest files if more are needed."""
    tokenizer = load_tokenizer(tokenizer_dir)
    encoded = [tokenizer.encode(read_text(path)) for path in source_files()[1]]
    found: list[list[int]] = []
    for offset in range(8):
        for ids in encoded:
            start = len(ids) // 2 + offset * length
            window = ids[start:start + length]
            if len(window) == length and window not in found:
                found.append(window)
            if len(found) == count:
                return found
    raise ValueError(f"prompts: only {len(found)} held-out windows of {length} tokens, {count} asked")


def requests_for(prompts: list[list[int]], count: int, max_tokens: int, k: int, mode: Mode) -> list:
    return [make_request(prompts[i % len(prompts)], max_tokens=max_tokens, ignore_eos=True,
                         temperature=mode.temperature, top_p=mode.top_p, seed=i if mode.temperature else None,
                         num_speculative_tokens=k, draft_mode=mode.draft_mode, timeout_s=REQUEST_TIMEOUT_S)
            for i in range(count)]


# ---------------------------------------------------------------------------------------------
# measurements from the chunks


def decode_steps(chunks: list[StreamChunk], k: int, max_tokens: int) -> list[tuple[int, int]]:
    """(drafts planned, drafts accepted) per decode step of one request; its first chunk is the
    prefill step (no drafts) and is left out. Planned = min(k, tokens left - 1), as the
    scheduler plans, 0 when the step ran without drafts (module docstring, section 3)."""
    steps, completion = [], len(chunks[0].token_ids)
    for chunk in chunks[1:]:
        planned = 0 if NO_DRAFT_REASONS & set(chunk.degraded) else min(k, max_tokens - completion - 1)
        steps.append((planned, sum(chunk.from_draft)))
        completion += len(chunk.token_ids)
    return steps


def acceptance(steps: list[tuple[int, int]], k: int) -> dict:
    """Per-position and pooled acceptance, and measured vs predicted tokens per step."""
    reached, accepted = [0] * k, [0] * k
    for planned, num_accepted in steps:
        for i in range(planned):
            reached[i] += num_accepted >= i
            accepted[i] += num_accepted > i
    a = sum(accepted) / sum(reached) if sum(reached) else 0.0
    full = [num_accepted + 1 for planned, num_accepted in steps if planned == k]
    measured = sum(full) / len(full) if full else float("nan")
    predicted = float(k + 1) if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return {"a": a, "a_per_position": [acc / r if r else None for acc, r in zip(accepted, reached)],
            "full_steps": len(full), "measured_tokens_per_step": measured, "predicted_tokens_per_step": predicted,
            "measured_over_predicted": measured / predicted}


def summarize(chunks: dict[str, list[StreamChunk]], wall_s: float, k: int, max_tokens: int) -> dict:
    finals = [c[-1] for c in chunks.values()]
    bad = [c for c in finals if c.error is not None or c.usage is None]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0].error}")
    tokens = sum(u.usage.completion_tokens for u in finals)
    steps = sum(u.usage.steps for u in finals)
    degraded: dict[str, int] = {}
    for final in finals:
        for reason, count in final.usage.degraded_steps.items():
            degraded[reason] = degraded.get(reason, 0) + count
    summary = {"requests": len(finals), "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s,
               "tokens_per_forward": tokens / steps, "steps": steps, "degraded_steps": degraded}
    if k:
        summary["acceptance"] = acceptance([s for c in chunks.values() for s in decode_steps(c, k, max_tokens)], k)
    return summary


# ---------------------------------------------------------------------------------------------
# runners


async def pipeline_run(client: Client, requests: list, concurrency: int, bar: tqdm) -> tuple[dict, float]:
    """Every request through the stack, at most `concurrency` in flight; (chunks, wall_s)."""
    gate = asyncio.Semaphore(concurrency)
    chunks: dict[str, list[StreamChunk]] = {}

    async def one(request) -> None:
        async with gate:
            chunks[request.request_id] = [chunk async for chunk in client.stream(request)]
        bar.update()

    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    return chunks, time.perf_counter() - start


async def scheduler_steps(stack: Stack) -> int:
    """Steps the stack's scheduler has run so far (its $SRV.STATS counters, asked on the
    stack's own connection: its user may ask $SRV, a client user may not)."""
    msg = await stack.nc.request("$SRV.STATS.scheduler", b"", timeout=5.0)
    return max(int(e.get("data", {}).get("steps", 0)) for e in json.loads(msg.data)["endpoints"])


def hf_generate(model, prompt: list[int], max_tokens: int, device: str, assistant=None) -> tuple[int, float]:
    """transformers greedy generate of one prompt (batch 1), exactly max_tokens: (tokens, wall_s)."""
    eos = model.generation_config.eos_token_id
    ids = torch.tensor([prompt], device=device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, do_sample=False, assistant_model=assistant,
                         pad_token_id=eos[0] if isinstance(eos, list) else eos)
    return out.shape[1] - ids.shape[1], time.perf_counter() - start


def throughput(tokens: int, wall_s: float, requests: int) -> dict:
    return {"requests": requests, "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s}


async def interleaved(client: Client, configs: list[list], bar: tqdm) -> list[tuple[dict, float]]:
    """Request i of every config, then request i+1 of every config..., one at a time (batch 1),
    so that load from other processes on a shared machine hits every config alike. Per config:
    (chunks of its requests, summed wall_s)."""
    results: list[tuple[dict, float]] = [({}, 0.0) for _ in configs]
    for index in range(len(configs[0])):
        for position, requests in enumerate(configs):
            chunks, wall_s = await pipeline_run(client, [requests[index]], 1, bar)
            results[position][0].update(chunks)
            results[position] = (results[position][0], results[position][1] + wall_s)
    return results


def ms_per_step(stage_s: dict, steps: int) -> dict:
    return {stage: 1e3 * stage_s.get(stage, 0.0) / steps for stage in STAGES}


# ---------------------------------------------------------------------------------------------
# the run


async def run_bench(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="specbus-bench-"))
    try:
        return await bench_in(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def bench_in(args: argparse.Namespace, work: Path) -> dict:
    target_dir, draft_dir, assistant_dir = work / "target", work / "draft", work / "assistant"
    shutil.copytree(args.target_model, target_dir)
    shutil.copytree(args.draft_model, draft_dir)
    device = args.device
    count = max(args.prompts, *args.scaling_batches, *args.overhead_batches)
    prompts = held_out_chat_prompts(load_tokenizer(target_dir), count) if args.chat else \
        held_out_prompts(target_dir, count, args.prompt_tokens)
    batch1 = prompts[:args.prompts]
    greedy = Mode("greedy", 0.0, "greedy")
    modes = [greedy, Mode("sampled/draft greedy", args.temperature, "greedy", args.top_p),
             Mode("sampled/draft sample", args.temperature, "sample", args.top_p)]
    result: dict = {"settings": {k: v for k, v in vars(args).items() if k != "results"},
                    "machine": machine(device)}
    export_assistant_draft(draft_dir, target_dir, assistant_dir)
    shortest = min(len(p) for p in batch1[:4])  # chat prompts differ in length: check on their common length
    result["assistant_export"] = check_expanded(draft_dir, assistant_dir,
                                                torch.tensor([p[:shortest] for p in batch1[:4]]))
    target, assistant = load_hf(target_dir, device), load_hf(assistant_dir, device)
    loop = load_inprocess(str(target_dir), str(draft_dir), device, max_slots=max(args.overhead_batches))
    config = StackConfig(target_model=str(target_dir), draft_model=str(draft_dir), log_level=args.log_level,
                         role_args={"scheduler": ["--draft-timeout-s", str(args.draft_timeout_s), "--lanes", str(args.lanes),
                                                  "--adaptive-k", args.adaptive_k],
                                    "verifier": ["--device", device], "drafter": ["--device", device]})
    with tqdm(total=1, desc="starting the stack") as bar:
        stack = await Stack(config).start()
        bar.update()
    try:
        async with stack.client() as client:
            for model, helper in ((target, None), (target, assistant)):  # warm-ups
                hf_generate(model, batch1[0], 4, device, helper)
            await client.generate(requests_for(batch1, 1, 4, args.peer_k, greedy)[0])
            run_requests(loop, requests_for(batch1, 1, 4, args.peer_k, greedy), 1)
            result["peer"] = await peer_section(args, client, target, assistant, batch1)
            del target, assistant
            result["speculation"] = await speculation_section(args, client, batch1, modes)
            result["theory"] = [{"mode": r["mode"], "k": r["k"], **r["acceptance"]}
                                for r in result["speculation"] if r["k"]]
            pipeline, result["bus_overhead"] = await batch_sections(args, stack, client, loop, prompts, greedy)
            result["batch_scaling"] = [pipeline[b] for b in args.scaling_batches]
    finally:
        await stack.stop()
    result["kernels"] = kernel_section(args)
    return result


async def peer_section(args, client: Client, target, assistant, prompts: list[list[int]]) -> dict:
    """Per prompt: transformers plain, transformers assisted, specbus greedy k=peer_k."""
    totals = {name: [0, 0.0] for name in ("hf_plain", "hf_assisted")}
    specbus = [requests_for([p], 1, args.max_tokens, args.peer_k, Mode("greedy", 0.0, "greedy"))
               for p in prompts]
    chunks, specbus_s = {}, 0.0
    with tqdm(total=3 * len(prompts), desc="peer: transformers and specbus") as bar:
        for prompt, requests in zip(prompts, specbus):
            for name, helper in (("hf_plain", None), ("hf_assisted", assistant)):
                tokens, wall_s = hf_generate(target, prompt, args.max_tokens, args.device, helper)
                totals[name][0] += tokens
                totals[name][1] += wall_s
                bar.update()
            got, wall_s = await pipeline_run(client, requests, 1, bar)
            chunks.update(got)
            specbus_s += wall_s
    peer = {name: throughput(tokens, wall_s, len(prompts)) for name, (tokens, wall_s) in totals.items()}
    summary = summarize(chunks, specbus_s, args.peer_k, args.max_tokens)
    peer["specbus"] = {key: summary[key] for key in ("requests", "tokens", "wall_s", "tokens_per_s")}
    peer["specbus_over_hf_plain"] = summary["tokens_per_s"] / peer["hf_plain"]["tokens_per_s"]
    peer["specbus_over_hf_assisted"] = summary["tokens_per_s"] / peer["hf_assisted"]["tokens_per_s"]
    return peer


async def speculation_section(args, client: Client, prompts: list[list[int]], modes: list[Mode]) -> list[dict]:
    runs = [(mode, k) for mode in modes for k in args.ks if k or mode.draft_mode == "greedy"]
    configs = [requests_for(prompts, len(prompts), args.max_tokens, k, mode) for mode, k in runs]
    with tqdm(total=len(runs) * len(prompts), desc="speculation: k x mode, batch 1") as bar:
        measured = await interleaved(client, configs, bar)
    rows = [{"mode": mode.name, "temperature": mode.temperature, "draft_mode": mode.draft_mode, "k": k,
             **summarize(chunks, wall_s, k, args.max_tokens)} for (mode, k), (chunks, wall_s) in zip(runs, measured)]
    for row in rows:
        k0 = next(r for r in rows if r["k"] == 0 and r["temperature"] == row["temperature"])
        row["ratio_to_k0"] = row["tokens_per_s"] / k0["tokens_per_s"]
    return rows


async def batch_sections(args, stack: Stack, client: Client, loop, prompts: list[list[int]],
                         greedy: Mode) -> tuple[dict, list]:
    """The pipeline at every concurrency (scaling), each overhead concurrency followed at once
    by the same requests in-process."""
    batches = sorted(set(args.overhead_batches) | set(args.scaling_batches))
    total = sum(max(b, args.prompts) * (2 if b in args.overhead_batches else 1) for b in batches)
    pipeline, overhead = {}, []
    with tqdm(total=total, desc="pipeline and in-process by concurrency") as bar:
        for batch in batches:
            count = max(batch, args.prompts)
            steps_before = await scheduler_steps(stack)
            chunks, wall_s = await pipeline_run(
                client, requests_for(prompts, count, args.max_tokens, args.peer_k, greedy), batch, bar)
            pipeline[batch] = {"batch": batch, **summarize(chunks, wall_s, args.peer_k, args.max_tokens),
                               "scheduler_steps": await scheduler_steps(stack) - steps_before}
            if batch in args.overhead_batches:
                overhead.append(overhead_row(args, loop, prompts, greedy, pipeline[batch], bar))
    return pipeline, overhead


def overhead_row(args, loop, prompts, greedy: Mode, piped: dict, bar: tqdm) -> dict:
    """The pipeline's batch against the same requests in-process. The in-process run also
    encodes and decodes every message (timed as its own stage); its throughput without the
    codec is taken over the wall time less that stage, so one run gives both."""
    batch = piped["batch"]
    count = max(batch, args.prompts)
    run = run_requests(loop, requests_for(prompts, count, args.max_tokens, args.peer_k, greedy), batch, codec=True)
    bar.update(count)
    wall_s = run.wall_s - run.stage_s["codec"]
    summary = summarize(run.chunks, wall_s, args.peer_k, args.max_tokens)
    # A request's step period: wall time x requests in flight / request steps. It compares a
    # one-loop run with a pipeline whose lanes each run a part of the batch per step.
    row = {"batch": batch, "inprocess_tokens_per_s": summary["tokens_per_s"],
           "inprocess_with_codec_tokens_per_s": summary["tokens"] / run.wall_s, "inprocess_steps": run.steps,
           "step_ms": ms_per_step(run.stage_s, run.steps), "inprocess_step_ms": 1e3 * wall_s * batch / summary["steps"],
           "pipeline_tokens_per_s": piped["tokens_per_s"], "pipeline_steps": piped["scheduler_steps"],
           "pipeline_step_ms": 1e3 * piped["wall_s"] * batch / piped["steps"]}
    row["bus_ms_per_step"] = row["pipeline_step_ms"] - row["inprocess_step_ms"]
    row["pipeline_over_inprocess"] = row["pipeline_tokens_per_s"] / row["inprocess_tokens_per_s"]
    return row


def kernel_section(args) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    kernels = []
    grid = [(b, k, v) for v in args.kernel_vocab for b in args.kernel_batch for k in args.kernel_k]
    for B, K, V in tqdm(grid, desc="kernels"):
        floor_s, timings = bench_one(B, K, V, args.kernel_reps, generator)
        kernels.append({"B": B, "K": K, "V": V, "floor_ms": 1e3 * floor_s,
                        **{name: 1e3 * t for name, t in timings.items()}})
    return kernels


def machine(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg(),
            "utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ---------------------------------------------------------------------------------------------
# output


def fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows])


def tables(result: dict) -> str:
    peer = result["peer"]
    parts = ["### Peer (greedy, batch 1)", table(
        ["system", "tokens/s", "specbus ratio"],
        [["transformers generate", peer["hf_plain"]["tokens_per_s"], peer["specbus_over_hf_plain"]],
         ["transformers assisted generate", peer["hf_assisted"]["tokens_per_s"], peer["specbus_over_hf_assisted"]],
         [f"specbus k={result['settings']['peer_k']}", peer["specbus"]["tokens_per_s"], 1.0]])]
    parts += ["### Speculation (batch 1)", table(
        ["mode", "k", "tokens/s", "tokens/forward", "ratio to k=0", "acceptance a", "degraded steps"],
        [[r["mode"], r["k"], r["tokens_per_s"], r["tokens_per_forward"], r["ratio_to_k0"],
          r.get("acceptance", {}).get("a"), sum(r["degraded_steps"].values())] for r in result["speculation"]])]
    parts += ["### Theory", table(
        ["mode", "k", "a", "a per position", "measured tokens/step", "(1-a^(k+1))/(1-a)", "ratio"],
        [[r["mode"], r["k"], r["a"], " ".join(fmt(x) for x in r["a_per_position"]), r["measured_tokens_per_step"],
          r["predicted_tokens_per_step"], r["measured_over_predicted"]] for r in result["theory"]])]
    parts += ["### Bus overhead (greedy, k=%d)" % result["settings"]["peer_k"], table(
        ["batch", "in-process tok/s", "pipeline tok/s", "pipeline / in-process", "in-process ms/request step",
         "pipeline ms/request step", "bus ms/request step", *[f"in-process {s} ms/step" for s in STAGES]],
        [[r["batch"], r["inprocess_tokens_per_s"], r["pipeline_tokens_per_s"], r["pipeline_over_inprocess"],
          r["inprocess_step_ms"], r["pipeline_step_ms"], r["bus_ms_per_step"], *r["step_ms"].values()]
         for r in result["bus_overhead"]])]
    parts += ["### Batch scaling (pipeline, greedy, k=%d)" % result["settings"]["peer_k"], table(
        ["concurrent requests", "requests", "tokens/s", "tokens/forward", "degraded steps"],
        [[r["batch"], r["requests"], r["tokens_per_s"], r["tokens_per_forward"], sum(r["degraded_steps"].values())]
         for r in result["batch_scaling"]])]
    names = [n for n in result["kernels"][0] if n not in ("B", "K", "V")]
    parts += ["### Kernels (ms per call)", table(["B", "K", "V", *names],
                                                 [[r["B"], r["K"], r["V"], *[r[n] for n in names]]
                                                  for r in result["kernels"]])]
    return "\n\n".join(parts) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    peer = result["peer"]
    ax = axes[0, 0]
    ax.bar(["transformers", "transformers\nassisted", "specbus"],
           [peer["hf_plain"]["tokens_per_s"], peer["hf_assisted"]["tokens_per_s"], peer["specbus"]["tokens_per_s"]])
    ax.set(title="greedy, batch 1", ylabel="tokens/s")
    ax = axes[0, 1]
    for mode in dict.fromkeys(r["mode"] for r in result["speculation"]):
        rows = [r for r in result["speculation"] if r["mode"] == mode or (r["k"] == 0 and r["temperature"] ==
                next(x["temperature"] for x in result["speculation"] if x["mode"] == mode))]
        ax.plot([r["k"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=mode)
    ax.set(title="speculation, batch 1", xlabel="k (draft tokens)", ylabel="tokens/s")
    ax.legend()
    ax = axes[1, 0]
    theory = result["theory"]
    ax.scatter([r["predicted_tokens_per_step"] for r in theory], [r["measured_tokens_per_step"] for r in theory])
    top = max([r["predicted_tokens_per_step"] for r in theory] + [r["measured_tokens_per_step"] for r in theory]
              + [1.0])
    ax.plot([1, top], [1, top], linestyle="--", color="gray")
    ax.set(title="tokens per step: measured vs (1-a^(k+1))/(1-a)", xlabel="predicted", ylabel="measured")
    ax = axes[1, 1]
    scaling = result["batch_scaling"]
    ax.plot([r["batch"] for r in scaling], [r["tokens_per_s"] for r in scaling], marker="o", label="pipeline")
    overhead = result["bus_overhead"]
    ax.plot([r["batch"] for r in overhead], [r["inprocess_tokens_per_s"] for r in overhead], marker="s",
            label="in-process (no bus)")
    ax.set(title="throughput by concurrency", xlabel="concurrent requests", ylabel="tokens/s", xscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-model", default=default_target_model())
    parser.add_argument("--draft-model", default=str(DEFAULT_DRAFT))
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N], for every model")
    parser.add_argument("--prompts", type=int, default=6, help="prompts (= requests) of the batch-1 runs")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 2, 4, 8])
    parser.add_argument("--peer-k", type=int, default=4, help="specbus k of the peer, bus and scaling sections")
    parser.add_argument("--temperature", type=float, default=1.0, help="of the sampled runs")
    parser.add_argument("--top-p", type=float, default=1.0, help="of the sampled runs")
    parser.add_argument("--chat", action="store_true",
                        help="prompts: held-out chat and code questions of ops/train/distill_draft.py in the target's chat "
                             "template (a chat model's use) instead of --prompt-tokens windows of stdlib files")
    parser.add_argument("--overhead-batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--scaling-batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--kernel-batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--kernel-k", type=int, nargs="+", default=[4])
    parser.add_argument("--kernel-vocab", type=int, nargs="+", default=[4096])
    parser.add_argument("--kernel-reps", type=int, default=5)
    parser.add_argument("--draft-timeout-s", type=float, default=2.0,
                        help="the scheduler's; above its 0.5 s default so a loaded CPU does not turn runs into k=0")
    parser.add_argument("--lanes", type=int, default=SchedulerConfig.lanes, help="the scheduler's step loops")
    parser.add_argument("--adaptive-k", choices=("true", "false"), default="false",
                        help="the scheduler's adaptive_k; off by default: the theory section counts every decode step "
                             "at k, and the in-process loop of the bus section reports no timings, so it runs at k "
                             "(ops/bench/drafts/bench_adaptive_k.py measures adaptive k)")
    parser.add_argument("--log-level", default="warning", help="of this process and the stack's services")
    parser.add_argument("--results", default=None, help="output folder (default ops/bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    if 0 not in args.ks or args.peer_k not in args.ks:
        parser.error(f"--ks must include 0 and --peer-k ({args.peer_k}), got {args.ks}")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Run the bench; returns the results folder."""
    args = parse_args(argv)
    configure_logging(level=args.log_level)
    out_dir = Path(args.results or RESULTS_ROOT / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = asyncio.run(run_bench(args))
    result["wall_s"] = time.perf_counter() - start
    text = tables(result)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "results.md").write_text(text)
    plot(result, out_dir / "bench.png")
    print(text)
    print(f"results: {out_dir} ({result['wall_s']:.0f} s)")
    return out_dir


if __name__ == "__main__":
    main()
