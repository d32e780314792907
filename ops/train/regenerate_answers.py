"""Regenerate ShareGPT answers with the target: self-distillation data for the EAGLE head.

    python ops/train/regenerate_answers.py --threads 1 --start 3904 --convs 512   # $SPECBUS_HOME/eagle-regen/answers.json
    python ops/train/train_eagle.py accumulate --data $SPECBUS_HOME/eagle-regen/answers.json ...   # train on them

At serving time the head predicts the target's continuation, not ShareGPT's (GPT-3.5's) answer;
Medusa-2, EAGLE and SpecForge train on the target's own answers. Steps, in order:

1. Prompts: the train-split conversations at positions --start .. --start + --convs - 1 of
   ops/train/train_eagle.py's `train_order` (the ones `accumulate` reaches next from a checkpoint at
   data position --start), minus the `--split select` ones (SELECT_CONVS) and those without a
   human turn answered by gpt; the first human turn rendered with the target's chat template
   (`render_chat`, generation prompt added, as `sharegpt_prompts` and `specbus generate --chat`
   do); longer than --max-prompt tokens: skipped.
2. Answers: --batch prompts at a time, one KVCache slot per row, a batched prefill then one token
   a `forward` per row still running (finished rows leave the batch). Position p is sampled when
   p % --sampled-every == 0 (temperature --temperature, top-p --top-p; gpu_worker.sampling.sampler,
   uniforms keyed by (seed = p, token position), so a row's answer does not depend on its batch),
   else greedy (argmax: with the runtime's row-invariant kernel the same ids as decoding the prompt
   alone). A row stops after an eos id (kept) or --max-new tokens.
3. Output (--out, default $SPECBUS_HOME/eagle-regen/answers.json): {"meta": the settings,
   "next_position": where a rerun goes on, "conversations": [...]}, each conversation in ShareGPT
   form ({"id", "conversations": [{"from": "human"}, {"from": "gpt", "value": the decoded answer}]})
   plus "position", "sampled", "prompt_len" and "ids": the prompt's ids then the answer's as
   generated (what `accumulate --data` prefills, so no re-tokenizing changes them). Rewritten after
   every batch (a temporary file renamed): an interrupted run resumes at next_position with the
   same --start and settings.

--dtype auto: the dtype and weights serving picks by default for the target on this CPU
(`resolve_dtype("auto", "cpu", target)` / `resolve_weights("auto", ...)`: the GGUF blocks by
integer dot products (weights int8dot) where the target directory has them and the projection
kernel serves them, else bf16 dense where the CPU
has native bf16, else float32); bfloat16 / float32: dense weights in that dtype. --fast turns the
runtime's fixed-order linear kernel off (SPECBUS_LINEAR_KERNEL=0, oneDNN): faster batched rows on
some CPUs, greedy rows then equal to one-row decoding only up to rounding.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from gpu_worker.sampling.sampler import STREAM_TARGET, SamplingTensors, make_uniforms, sample
from schemas.config import default_target_model, specbus_home
from services.commands.bench_serve_core import first_exchange, load_sharegpt
from text.chat_template import render_chat
from text.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_eagle import SELECT_CONVS, train_order  # noqa: E402

# the settings a resumed file must share with the run (its meta); --convs may grow between runs
KEPT = ("start", "max_new", "max_prompt", "sampled_every", "temperature", "top_p", "dtype", "weights", "target")


def default_out() -> Path:
    return specbus_home() / "eagle-regen" / "answers.json"


def pick_prompts(tokenizer, conversations: list[dict], positions: range, max_prompt: int,
                 exclude: frozenset[str]) -> list[dict]:
    """Step 1: {"position", "id", "text", "ids"} of the usable conversations at the given
    positions of train_order(conversations)."""
    order = train_order(conversations)
    picked = []
    for p in positions:
        if p >= len(order):
            break
        conversation = conversations[order[p]]
        exchange = first_exchange(conversation)
        if conversation["id"] in exclude or exchange is None or not exchange[0].strip():
            continue
        ids = tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": exchange[0]}]))
        if len(ids) <= max_prompt:
            picked.append({"position": p, "id": conversation["id"], "text": exchange[0], "ids": ids})
    return picked


@torch.inference_mode()
def generate_batch(model, config, prompts: list[list[int]], params: SamplingTensors, seeds: torch.Tensor,
                   max_new: int, eos_ids: tuple[int, ...]) -> list[list[int]]:
    """Step 2 for B prompts: each row's answer ids (eos included where it stopped on one).
    params: B rows (temperature 0 = greedy); seeds (B,) int64 key the sampled rows' uniforms."""
    B = len(prompts)
    assert seeds.shape == (B,) and params.temperature.shape == (B,), (seeds.shape, params.temperature.shape)
    lens = torch.tensor([len(p) for p in prompts])
    cache = KVCache(config, max_slots=B, max_seq_len=int(lens.max()) + max_new, device=model.embed.device,
                    dtype=model.embed.dtype)
    slots = torch.tensor([cache.allocate() for _ in prompts])
    tokens = torch.zeros(B, int(lens.max()), dtype=torch.long)                # (B, T), padded
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    logits = forward(model, cache, slots, tokens, lens, logits_index=(lens - 1)[:, None])  # (B, 1, V)
    answers = [[] for _ in prompts]
    rows = torch.arange(B)                                                    # rows still running
    while True:
        positions = cache.lengths[slots[rows]].long()[:, None]                # (b, 1): the drawn token's
        uniforms = make_uniforms(seeds[rows], positions, STREAM_TARGET)
        _, drawn = sample(logits, params.index(rows), uniforms)               # (b, 1)
        running = []
        for b, t in zip(rows.tolist(), drawn[:, 0].tolist()):
            answers[b].append(t)
            if t not in eos_ids and len(answers[b]) < max_new:
                running.append(b)
        if not running:
            return answers
        keep = torch.tensor([rows.tolist().index(b) for b in running])
        rows = torch.tensor(running)
        logits = forward(model, cache, slots[rows], drawn[keep], torch.ones(len(rows), dtype=torch.long))


def read_progress(out: Path, meta: dict) -> tuple[list[dict], int]:
    """(conversations written, next position) of out, or ([], start) when it is not there;
    SystemExit when out was written with other settings."""
    if not out.exists():
        return [], meta["start"]
    data = json.loads(out.read_text())
    theirs = {k: data["meta"].get(k) for k in KEPT}
    if theirs != {k: meta[k] for k in KEPT}:
        raise SystemExit(f"{out} was written with {theirs}, not {({k: meta[k] for k in KEPT})}: pass those or "
                         f"another --out")
    return data["conversations"], data["next_position"]


def write_progress(out: Path, meta: dict, conversations: list[dict], next_position: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "next_position": next_position, "conversations": conversations}))
    tmp.rename(out)


def regenerate(target: Path, out: Path, start: int, convs: int, batch: int = 16, max_new: int = 256,
               max_prompt: int = 256, sampled_every: int = 4, temperature: float = 0.8, top_p: float = 0.95,
               dtype: torch.dtype = torch.float32, weights: str = "dense", conversations: list[dict] | None = None,
               exclude: frozenset[str] = frozenset(), log=print) -> dict:
    """Steps 1-3 for positions start .. start + convs - 1 (conversations: the train split, loaded
    when None); goes on from out's next_position. Returns out's meta and counts."""
    meta = {"start": start, "max_new": max_new, "max_prompt": max_prompt, "sampled_every": sampled_every,
            "temperature": temperature, "top_p": top_p, "dtype": str(dtype).removeprefix("torch."), "weights": weights,
            "target": Path(target).name}
    written, position = read_progress(out, meta)
    tokenizer = load_tokenizer(target)
    conversations = load_sharegpt(split="train") if conversations is None else conversations
    prompts = pick_prompts(tokenizer, conversations, range(position, start + convs), max_prompt, exclude)
    model, config = load_model(target, dtype=dtype, max_seq_len=max_prompt + max_new, weights_format=weights)
    eos = tuple(tokenizer.eos_ids)
    t0, new_tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        sampled = [c["position"] % sampled_every == 0 for c in chunk]
        params = SamplingTensors.build([temperature if s else 0.0 for s in sampled],
                                       top_p=[top_p if s else 1.0 for s in sampled])
        answers = generate_batch(model, config, [c["ids"] for c in chunk], params,
                                 torch.tensor([c["position"] for c in chunk]), max_new, eos)
        for c, s, answer in zip(chunk, sampled, answers):
            text = tokenizer.decode([t for t in answer if t not in eos])
            written.append({"id": c["id"], "position": c["position"], "sampled": s, "prompt_len": len(c["ids"]),
                            "ids": c["ids"] + answer,
                            "conversations": [{"from": "human", "value": c["text"]}, {"from": "gpt", "value": text}]})
            new_tokens += len(answer)
        done = i + batch >= len(prompts)
        position = start + convs if done else prompts[i + batch]["position"]
        write_progress(out, meta, written, position)
        rate = new_tokens / (time.perf_counter() - t0)
        log(f"{len(written)} conversations, next position {position}; {new_tokens} answer tokens this run, "
            f"{rate:.1f} tokens/s")
    if not prompts:
        write_progress(out, meta, written, start + convs)
    answer_tokens = sum(len(c["ids"]) - c["prompt_len"] for c in written)
    return dict(meta, conversations=len(written), answer_tokens=answer_tokens, run_answer_tokens=new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=Path(default_target_model()))
    parser.add_argument("--out", type=Path, default=None, help="default $SPECBUS_HOME/eagle-regen/answers.json")
    parser.add_argument("--start", type=int, required=True, help="first position of the seeded train order")
    parser.add_argument("--convs", type=int, required=True, help="positions to cover")
    parser.add_argument("--batch", type=int, default=16, help="prompts a forward")
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--sampled-every", type=int, default=4, help="position p sampled when p %% n == 0")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--dtype", default="auto", help="auto (serving's default here), float32, bfloat16 (dense)")
    parser.add_argument("--fast", action="store_true", help="oneDNN instead of the row-invariant linear kernel")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fast:
        os.environ["SPECBUS_LINEAR_KERNEL"] = "0"  # read at the first model load
    from gpu_worker.batching.slots import resolve_dtype, resolve_weights
    dtype = resolve_dtype(args.dtype, "cpu", str(args.target) if args.dtype == "auto" else None)
    weights = resolve_weights("auto", str(args.target), dtype, "cpu") if args.dtype == "auto" else "dense"
    train_split = load_sharegpt(split="train")
    exclude = frozenset(c["id"] for c in train_split[-SELECT_CONVS:])
    result = regenerate(args.target, args.out or default_out(), args.start, args.convs, args.batch, args.max_new,
                        args.max_prompt, args.sampled_every, args.temperature, args.top_p, dtype, weights,
                        conversations=train_split, exclude=exclude)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
