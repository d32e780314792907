"""Train the EAGLE-style feature-level draft for SmolLM2-135M-Instruct (models/smollm2-eagle).

    python ops/train/train_eagle.py features --threads 1    # target features of ShareGPT train conversations
    python ops/train/train_eagle.py train --threads 1 --follow   # train the head (--resume continues)
    python ops/train/train_eagle.py eval --threads 1        # held-out ShareGPT: acceptance, speed, lossless
    nice -n 19 python ops/train/train_eagle.py accumulate --threads 1 --tokens 2000000   # add to the served head

--target DIR: the HF-layout directory of the target (default: where `specbus models pull` puts
it). Features go to $SPECBUS_HOME/eagle-data (shards of --shard-convs conversations, kept: an
interrupted run resumes at the next missing shard); checkpoints to .train/smollm2-eagle/; the head
is exported to models/smollm2-eagle/ at every checkpoint. `--device cuda` runs any stage on a GPU.

`accumulate`: training that adds up across runs and machines. Its checkpoint (eagle_training.save_state:
weights, Adam's second moments, step, data position) lives in $SPECBUS_HOME/train/smollm2-eagle or
--state DIR, never in models/ (what is served); without one a run starts from the served head
(eagle_training.accumulate_start), --init-head (--init-convs: the conversations it saw) or, --fresh,
a new head. Each run trains on the next conversations of the seeded order (prefilled unless on disk)
for --tokens new tokens, saving and exporting (--out) every --save-every seconds and on SIGINT / SIGTERM.
--data FILE: the target's own answers to the same prompts (ops/train/regenerate_answers.py) instead of
ShareGPT's: shard n of FILE answers the prompts of ShareGPT's shard n, so the data position
counts alike; its features go to $SPECBUS_HOME/eagle-data/regen-<stem of FILE>.

A head may read EAGLE-3's fused target layers (ops/train/eagle_fused.py); `eval` runs either kind.

Design (gpu_worker/runtime/eagle.py has the head):
- Data: ShareGPT's train split only (services/commands/bench_serve_core.load_sharegpt; the
  held-out tenth, sha1(id) % 10 == 0, is for `eval` alone), every conversation rendered with the
  target's chat template (its default system prompt, as `specbus generate --chat` sends it),
  cut to --max-len tokens. Teacher-forced prefill with specbus's own runtime
  (gpu_worker.runtime.model.forward(return_hidden=True)) in the dtype serving picks by default
  (bf16 where the CPU has native bf16), so the features are what a verifier returns up to
  rounding (prefill runs oneDNN's GEMM, not the serving path's fixed-order kernel): per position
  the final-normed hidden state (bf16, what the serving path ships) and the token id. The
  target's next-token distribution is those features times its lm_head.
- Loss per position after the system prompt: smooth L1 between the predicted and the target's
  next feature (EAGLE-1) plus cross-entropy of the head's distribution against the target's (both over the
  reduced vocabulary d2t), also at the steps of a chain where the
  head reads its own predicted features (`--unroll`): what it does when drafting k > 1 tokens.
"""

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from text.chat_template import render_chat
from gpu_worker.batching.slots import resolve_dtype
from gpu_worker.runtime.checkpoint import D2T, load_model, our_name, read_config, weight_files
from gpu_worker.runtime.eagle import EagleConfig, load_head_weights, weight_names
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward, forward_layers
from text.tokenizer import load_tokenizer
from schemas.config import default_target_model, specbus_home
from services.commands.bench_serve_core import load_sharegpt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_draft import COPIED_FILES, DRAFT_VOCAB  # noqa: E402
from eagle_training import (accumulate_start, batch_tensors, calibrate_out_norm, chain_losses, init_weights,  # noqa: E402
                             load_shards, load_state, new_optimizer, regenerated_shards, restore_optimizer, round_plan,
                             save_head, save_state, start_counters, train_step, write_shard)
from train_models import lr_at  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "models" / "smollm2-eagle"
WORK = REPO / ".train" / "smollm2-eagle"
SEED = 1234
REPLAY_SHARDS = 8  # accumulate replays conversations of the shards just before the new one
WARMUP = 50  # accumulate: Adam steps of linear learning-rate warmup from a fresh optimizer
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant"}


def data_dir() -> Path:
    return specbus_home() / "eagle-data"


# ---------------------------------------------------------------------------------------------
# features


def chat_messages(conversation: dict) -> list[dict]:
    """ShareGPT turns as chat messages: human -> user, gpt (and the few other assistants) ->
    assistant; leading assistant turns and unknown roles (system) dropped, so every rendering
    starts with the template's default system prompt and a user turn, as served requests do."""
    messages = []
    for turn in conversation.get("conversations") or []:
        role = ROLES.get(turn.get("from"))
        if role is None or (not messages and role != "user"):
            continue
        messages.append({"role": role, "content": str(turn.get("value", ""))})
    return messages


def encode_conversation(tokenizer, conversation: dict, max_len: int) -> tuple[list[int], int] | None:
    """(ids cut to max_len, where the loss starts) or None for a conversation with no user turn
    or too short. The loss starts at the first user turn: every rendering shares the system
    prompt before it. A regenerated conversation (ops/train/regenerate_answers.py) brings its "ids"
    (the rendered prompt, then the target's answer as generated): those are used as they are."""
    messages = chat_messages(conversation)
    if not messages:
        return None
    ids = (list(conversation["ids"]) if "ids" in conversation
           else tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt=False)))[:max_len]
    header = tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": ""}], add_generation_prompt=False))
    start = next((i for i, (a, b) in enumerate(zip(ids, header)) if a != b), len(header))
    start = max(0, start - 1)  # the header's last token may merge with the message's first
    return (ids, start) if len(ids) > start + 8 else None


def without_lm_head(model):
    """The model with a one-row lm_head: `forward(return_hidden=True)` then returns the same
    hidden states (the head does not touch them) without the (T, 49152) logits it never needs."""
    import dataclasses

    from gpu_worker.runtime.model import pack_weight
    one_row = pack_weight(model.embed[:1].contiguous())
    return dataclasses.replace(model, lm_head=one_row, config=dataclasses.replace(model.config, vocab_size=1))


@torch.inference_mode()
def conversation_features(model, config, cache: KVCache, ids: list[int], device: str) -> torch.Tensor:
    """Teacher-forced prefill of one conversation: its final-normed hidden states (T, E) as bf16
    (what the serving path ships). The target's labels are not stored: they are these features
    times the target's lm_head, which `train` computes over the draft's reduced vocabulary (the
    full 49152-row lm_head would be a fifth of this prefill's cost)."""
    slot = cache.allocate()
    try:
        T = len(ids)
        _, hidden = forward(without_lm_head(model), cache, torch.tensor([slot]), torch.tensor([ids]),
                            torch.tensor([T]), return_hidden=True)
    finally:
        cache.free(slot)
    return hidden[0].to(torch.bfloat16).cpu()


def train_order(conversations: list) -> list[int]:
    """The seeded shuffle of the train split that `features` and `accumulate` walk: shard n holds
    its conversations n * shard_convs .. (n + 1) * shard_convs - 1, so any prefix is a random sample."""
    return random.Random(SEED).sample(range(len(conversations)), len(conversations))


def prefill_target(target: Path, max_len: int, device: str):
    """(target without its lm_head, config, one-slot cache) for teacher-forced prefill, in the
    dtype serving picks by default (`resolve_dtype("auto")`: bf16 on CUDA and on CPUs with
    native bf16, else float32)."""
    dtype = resolve_dtype("auto", device)
    model, config = load_model(target, device=device, dtype=dtype, max_seq_len=max_len)
    return without_lm_head(model), config, KVCache(config, max_slots=1, max_seq_len=max_len, device=device, dtype=dtype)


def write_features(path: Path, prefill, tokenizer, conversations: list[dict], max_len: int, device: str,
                   stop=None) -> int | None:
    """Prefill each conversation with `prefill` (prefill_target's triple) and write the shard
    `path`; the tokens written, or None (nothing written) when stop() turned true on the way."""
    model, config, cache = prefill
    rows = []
    for conversation in conversations:
        if stop is not None and stop():
            return None
        encoded = encode_conversation(tokenizer, conversation, max_len)
        if encoded is not None:
            ids, start = encoded
            rows.append({"id": conversation["id"], "start": start, "ids": torch.tensor(ids),
                         "features": conversation_features(model, config, cache, ids, device)})
    write_shard(path, rows)
    return sum(len(r["ids"]) for r in rows)


def extract_features(target: Path, max_len: int, shard_convs: int, max_convs: int, device: str) -> None:
    """Shards data_dir()/feat-NNNN.safetensors of shard_convs train conversations each (train_order);
    existing shards are skipped."""
    tokenizer = load_tokenizer(target)
    prefill = prefill_target(target, max_len, device)
    conversations = load_sharegpt(split="train")
    order = train_order(conversations)[:max_convs or None]
    shards = [order[i:i + shard_convs] for i in range(0, len(order), shard_convs)]
    done_tokens, t0 = 0, time.time()
    bar = tqdm(shards, desc="features", unit="shard")
    for n, indices in enumerate(bar):
        path = shard_path(n)
        if not path.exists():
            chosen = [conversations[i] for i in indices]
            done_tokens += write_features(path, prefill, tokenizer, chosen, max_len, device)
            bar.set_postfix(tok_s=f"{done_tokens / (time.time() - t0):.0f}", tokens=done_tokens)


def shard_path(n: int, directory: Path | None = None) -> Path:
    return (directory or data_dir()) / f"feat-{n:04d}.safetensors"


def shard_paths() -> list[Path]:
    return sorted(data_dir().glob("feat-*.safetensors"))


# ---------------------------------------------------------------------------------------------
# train


def target_weights(target: Path) -> dict[str, torch.Tensor]:
    """The target's tensors in our names (`model.weight_names`), float32, as stored (unpacked)."""
    weights = {}
    for file in weight_files(target):
        with safe_open(file, framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                name = our_name(hf_name)
                if name is not None:
                    weights[name] = f.get_tensor(hf_name).float()
    return weights


def text_counts(target: Path, conversations: int, vocab_size: int) -> torch.Tensor:
    """(V,) how often each target id occurs in the first `conversations` train conversations of
    the seeded order, rendered as `features` renders them (tokenizing is cheap; prefill is not)."""
    tokenizer = load_tokenizer(target)
    train_split = load_sharegpt(split="train")
    order = train_order(train_split)[:conversations]
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for i in order:
        encoded = encode_conversation(tokenizer, train_split[i], 1 << 30)
        if encoded is not None:
            counts += torch.bincount(torch.tensor(encoded[0][encoded[1]:]), minlength=vocab_size)
    return counts


@torch.no_grad()
def head_vocabulary(rows: list[dict], lm_head: torch.Tensor, text: torch.Tensor, max_positions: int = 5_000) -> D2T:
    """The DRAFT_VOCAB - 1 target ids the head may propose, plus "other" (never proposed): ranked
    by how often each is the target's greedy next token over (up to max_positions) training
    positions, then by its count in the training text `text` (V,), then by id."""
    V = lm_head.shape[0]
    greedy = torch.zeros(V, dtype=torch.float64)
    seen = 0
    for row in rows:
        if seen >= max_positions:
            break
        greedy += torch.bincount((row["features"].float() @ lm_head.T).argmax(-1), minlength=V)
        seen += len(row["ids"])
    kept = torch.argsort(greedy + text / (text.sum() + 1), descending=True, stable=True)[:DRAFT_VOCAB - 1]
    other_id = DRAFT_VOCAB - 1
    t2d = torch.full((V,), other_id, dtype=torch.long)
    t2d[kept] = torch.arange(DRAFT_VOCAB - 1)
    return D2T(torch.cat([kept, torch.tensor([0])]), t2d, other_id)


def train(target: Path, steps: int, batch: int, peak_lr: float, unroll: int, reg_weight: float,
          init_layer: int | None, resume: bool, follow: bool, device: str, save_every_s: float = 300.0,
          vocab_text_convs: int = 1000) -> None:
    """Train the head for `steps` steps of `batch` conversations; follow: read new feature shards
    at every pass (training may start while `features` still writes them)."""
    torch.manual_seed(SEED)
    WORK.mkdir(parents=True, exist_ok=True)
    ckpt_path = WORK / "head.pt"
    ckpt = torch.load(ckpt_path, weights_only=False) if resume and ckpt_path.exists() else None
    tw = target_weights(target)
    tconfig = read_config(target)
    config = EagleConfig.from_target(tconfig)
    embed = tw["embed"].to(device)
    paths = shard_paths()
    if not paths:
        raise SystemExit(f"no feature shards in {data_dir()}: run `python ops/train/train_eagle.py features` first")
    rows = load_shards(paths)
    if ckpt is not None:
        maps, weights = ckpt["maps"], ckpt["weights"]
    else:
        text = (torch.zeros(tconfig.vocab_size, dtype=torch.float64) if vocab_text_convs == 0 else
                text_counts(target, vocab_text_convs, tconfig.vocab_size))
        maps = head_vocabulary(rows, tw["embed"], text)
        weights = init_weights(config, tw, init_layer, seed=SEED)
    weights = {n: t.to(device) for n, t in weights.items()}
    lm_rows = embed[maps.d2t.to(device)]
    if ckpt is None:
        calibrate_out_norm(weights, config, embed, lm_rows, maps.other_id, batch_tensors(rows[:batch], device))
    weights = {n: t.requires_grad_(True) for n, t in weights.items()}
    opt = torch.optim.AdamW(list(weights.values()), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(SEED)
    start, order = 0, []
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        rng.setstate(ckpt["rng"])
        start, order = ckpt["step"], ckpt["order"]
    tokens = sum(len(r["ids"]) for r in rows)
    print(f"head: {sum(t.numel() for t in weights.values()) / 1e6:.2f}M params; {len(rows)} conversations "
          f"({tokens} tokens) in {len(paths)} shards; {steps} steps x {batch} conversations, unroll {unroll}",
          flush=True)
    by_id = {r["id"]: r for r in rows}
    last_save, ema = time.time(), {}
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="train")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup=min(100, steps // 10))
        if len(order) < batch:  # a new pass over the conversations, shuffled
            if follow and len(shard_paths()) > len(paths):
                new = shard_paths()[len(paths):]
                paths += new
                by_id.update({r["id"]: r for r in load_shards(new)})
            order = order + rng.sample(sorted(by_id), len(by_id))
        picked, order = order[:batch], order[batch:]
        train_step(weights, opt, config, embed, lm_rows, maps.other_id, [by_id[i] for i in picked], unroll,
                   reg_weight, device, ema)
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items() if not k.startswith("reg") or k == "reg1"},
                        convs=len(by_id))
        if time.time() - last_save > save_every_s or step + 1 == steps:
            state = {n: t.detach().cpu() for n, t in weights.items()}
            torch.save({"weights": state, "opt": opt.state_dict(), "rng": rng.getstate(), "step": step + 1,
                        "order": order, "maps": maps, "config": config}, ckpt_path)
            export(target, config, state, maps)
            bar.write(f"step {step + 1}: " + " ".join(f"{k}={v:.3f}" for k, v in ema.items()))
            last_save = time.time()


def export(target: Path, config: EagleConfig, weights: dict[str, torch.Tensor], maps: D2T,
           out: Path | None = None) -> None:
    """out (default OUT, models/smollm2-eagle): the head (bf16), d2t and the target's tokenizer
    files (a drafter pairs with a verifier only when the tokenizers hash the same)."""
    import shutil

    out = out or OUT
    save_head(out, config, weights, maps)
    for name in COPIED_FILES:
        if (target / name).exists():
            shutil.copyfile(target / name, out / name)


# ---------------------------------------------------------------------------------------------
# accumulate: training that adds to the checkpoint committed in the repository


class Shards:
    """Feature shards of train_order by number: read from data_dir(), prefilled and written when
    missing (the target, its tokenizer and ShareGPT loaded at the first need), the last
    keep + 1 read kept in memory for replay. data: a regenerated-answers file
    (ops/train/regenerate_answers.py) instead of ShareGPT's answers: shard n holds its answers to the
    prompts of ShareGPT's shard n (eagle_training.regenerated_shards), in data_dir()/regen-<stem>."""

    def __init__(self, target: Path, shard_convs: int, max_len: int, device: str, keep: int,
                 exclude: frozenset[str] = frozenset(), data: Path | None = None):
        self.target, self.shard_convs, self.max_len, self.device, self.keep = target, shard_convs, max_len, device, keep
        self.exclude = exclude  # conversation ids never trained on (prefilled only where a shard has them)
        self.data, self.dir = data, data_dir() if data is None else data_dir() / f"regen-{Path(data).stem}"
        self.cache: dict[int, list[dict]] = {}
        self.source = None  # (tokenizer, shard n -> its conversations or None, prefill)

    def on_disk(self, n: int) -> list[dict] | None:
        if n not in self.cache and shard_path(n, self.dir).exists():
            self.cache = {m: rows for m, rows in self.cache.items() if m >= n - self.keep}
            self.cache[n] = [row for row in load_shards([shard_path(n, self.dir)]) if row["id"] not in self.exclude]
        return self.cache.get(n)

    def conversations(self):
        """shard n -> its conversations, or None past the end of the data."""
        if self.data is not None:
            return regenerated_shards(self.data, self.shard_convs)
        conversations = load_sharegpt(split="train")
        order, k = train_order(conversations), self.shard_convs
        return lambda n: [conversations[i] for i in order[n * k:(n + 1) * k]] or None

    def get(self, n: int, stop=None) -> list[dict] | None:
        """Shard n's rows, prefilled now if missing; None past the end of the data or when
        stop() turned true while prefilling."""
        if self.on_disk(n) is not None:
            return self.cache[n]
        if self.source is None:
            self.source = (load_tokenizer(self.target), self.conversations(),
                           prefill_target(self.target, self.max_len, self.device))
        tokenizer, shard, prefill = self.source
        if (chosen := shard(n)) is None:
            return None
        wanted = [c for c in chosen if c["id"] not in self.exclude]
        if write_features(shard_path(n, self.dir), prefill, tokenizer, wanted, self.max_len, self.device, stop) is None:
            return None
        return self.on_disk(n)

    def replay_pool(self, n: int) -> list[dict]:
        """The conversations of the up to `keep` shards before n that are on disk here."""
        return [row for m in range(max(0, n - self.keep), n) for row in (self.on_disk(m) or [])]


def open_state(state_dir: Path, init_head: Path | None, init_convs: int, shard_convs: int, max_len: int,
               target: Path):
    """(weights, second moments, maps, counters) from state_dir's checkpoint; else from the head
    directory init_head, taken to have consumed the first init_convs conversations of
    train_order; else None (a fresh head)."""
    if (state := load_state(state_dir)) is not None:
        c = state[3]
        if (c["shard_convs"], c["max_len"]) != (shard_convs, max_len):
            raise SystemExit(f"{state_dir} counts its data position in shards of {c['shard_convs']} conversations "
                             f"of {c['max_len']} tokens: pass --shard-convs {c['shard_convs']} --max-len {c['max_len']}")
        return state
    if init_head is None:
        return None
    if init_convs % shard_convs:
        raise SystemExit(f"--init-convs {init_convs} must be a multiple of --shard-convs {shard_convs}")
    _, weights, maps = load_head_weights(init_head)
    tokens = 0
    if init_convs:
        tokenizer, split = load_tokenizer(target), load_sharegpt(split="train")
        encoded = [encode_conversation(tokenizer, split[i], max_len) for i in train_order(split)[:init_convs]]
        tokens = sum(len(e[0]) for e in encoded if e is not None)
    return weights, {}, maps, start_counters(init_convs, tokens, shard_convs, max_len)


def fresh_head(target: Path, tw: dict, config: EagleConfig, rows: list[dict], vocab_convs: int, batch: int,
               device: str) -> tuple[dict[str, torch.Tensor], D2T]:
    """A new head as `train` makes one: the vocabulary ranked on rows and vocab_convs
    conversations' text, random weights, out_norm calibrated on the first batch."""
    vocab_size = tw["embed"].shape[0]
    text = (torch.zeros(vocab_size, dtype=torch.float64) if vocab_convs == 0 else
            text_counts(target, vocab_convs, vocab_size))
    maps = head_vocabulary(rows, tw["embed"], text)
    weights = {n: t.to(device) for n, t in init_weights(config, tw, seed=SEED).items()}
    embed = tw["embed"].to(device)
    calibrate_out_norm(weights, config, embed, embed[maps.d2t.to(device)], maps.other_id,
                       batch_tensors(rows[:batch], device))
    return weights, maps


def accumulate(target: Path, goal_tokens: int, batch: int, lr: float, unroll: int, reg_weight: float, replay: float,
               device: str, state_dir: Path, init_head: Path | None = None, init_convs: int = 0,
               shard_convs: int = 32, max_len: int = 512, vocab_convs: int = 1000, save_every_s: float = 300.0,
               stop=None, out: Path | None = None, exclude: frozenset[str] = frozenset(),
               data: Path | None = None) -> dict:
    """Train on goal_tokens new tokens past the checkpoint's data position, one shard at a time.

    Per round: shard n = position / shard_convs (prefilled now unless on disk), its conversations
    plus replay x as many from the shards before it that are on disk (round_plan), `batch` a step;
    then the position moves past it. lr: constant after a warmup over Adam's first WARMUP steps.
    The checkpoint (state_dir, save_state) and the head export (out) are written every
    save_every_s, at the end, and when stop() turns true (then mid-round: round_step says how far).
    exclude: conversation ids left out (main passes the `--split select` ones, so that comparing
    checkpoints on them stays fair). data: train on a regenerated-answers file (Shards).
    Returns the counters and run_tokens, the new tokens this run trained on."""
    stopped = (lambda: False) if stop is None else stop
    bf16_matmuls = resolve_dtype("auto", device) == torch.bfloat16
    tw = target_weights(target)
    config = EagleConfig.from_target(read_config(target))
    embed = tw["embed"].to(device)
    shards = Shards(target, shard_convs, max_len, device, keep=REPLAY_SHARDS, exclude=exclude, data=data)
    state = open_state(state_dir, init_head, init_convs, shard_convs, max_len, target)
    if state is None:
        first = shards.get(0, stopped)
        if first is None:
            return {}
        weights, maps = fresh_head(target, tw, config, first, vocab_convs, batch, device)
        state = (weights, {}, maps, start_counters(0, 0, shard_convs, max_len))
    weights, moments, maps, c = state
    # one order whatever the source: the clipped gradient norm sums over it
    weights = {n: weights[n].to(device).requires_grad_(True) for n in weight_names()}
    lm_rows = embed[maps.d2t.to(device)]
    opt = new_optimizer(weights, lr)
    restore_optimizer(opt, moments, c["adam_step"])
    bar = tqdm(total=goal_tokens, unit="tok", unit_scale=True, desc="accumulate", mininterval=5, smoothing=0.05)
    bar.write(f"from step {c['step']}, {c['position']} conversations, {c['tokens']} tokens; unroll {unroll}, "
              f"lr {lr}, replay {replay}, batch {batch}, bf16 matmuls {bf16_matmuls}")
    ema, run_tokens, last_save = {}, 0, time.time()

    def save() -> float:
        state_weights = {n: t.detach().cpu() for n, t in weights.items()}
        save_state(state_dir, state_weights, opt, maps, c)  # and opt now holds what the file holds
        export(target, config, state_weights, maps, out)
        bar.write(f"saved step {c['step']}: {c['position']} conversations, {c['tokens']} tokens; "
                  + " ".join(f"{k}={v:.3f}" for k, v in ema.items() if not k.startswith("reg")))
        return time.time()

    while run_tokens < goal_tokens and not stopped():
        n = c["position"] // shard_convs
        new = shards.get(n, stopped)
        if new is None:
            break
        new_ids = {r["id"] for r in new}
        for rows in round_plan(SEED, n, new, shards.replay_pool(n), replay, batch)[c["round_step"]:]:
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (c["adam_step"] + 1) / WARMUP)
            train_step(weights, opt, config, embed, lm_rows, maps.other_id, rows, unroll, reg_weight, device, ema,
                       bf16_matmuls)
            c["step"], c["adam_step"], c["round_step"] = c["step"] + 1, c["adam_step"] + 1, c["round_step"] + 1
            fresh = sum(len(r["ids"]) for r in rows if r["id"] in new_ids)
            run_tokens += fresh
            bar.update(fresh)
            bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items() if k.startswith("acc")}, convs=c["position"])
            if stopped():
                break
            if time.time() - last_save > save_every_s:
                last_save = save()
        else:
            c["position"], c["round_step"] = c["position"] + shard_convs, 0
            c["tokens"] += sum(len(r["ids"]) for r in new)
    save()
    bar.close()
    return dict(c, run_tokens=run_tokens)


# ---------------------------------------------------------------------------------------------
# eval: speculative greedy decoding in process, with the real target


@torch.inference_mode()
def speculative_greedy(target, tconfig, head, prompt: list[int], max_new: int, k: int,
                       eos_ids: tuple[int, ...]) -> tuple[list[int], dict]:
    """Greedy decoding of up to max_new tokens after prompt (stopping after an eos id): k = 0 is
    plain decoding, one target forward per token; k > 0 drafts k tokens with the head, verifies
    them in one target forward of k + 1 tokens and keeps the longest agreeing prefix plus the
    target's own next token. Features reach the head as bf16, as the serving path ships them; a
    fused head's (its config's feature_layers) are the target layers' inputs (model.forward_layers).
    Returns (token ids, {"steps": target forwards after the prefill, "tried": (k,) drafts at each
    position that were verified, "accepted": (k,) of those accepted})."""
    from gpu_worker.runtime.eagle import draft_chain, new_cache

    length = len(prompt) + max_new + k + 1
    cache = KVCache(tconfig, max_slots=1, max_seq_len=length, device=target.embed.device, dtype=target.embed.dtype)
    slot = torch.tensor([cache.allocate()])
    layers = head.config.feature_layers if k else ()

    def verify(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward over tokens: (logits (1, T, V), what the head reads (1, T, E or F*E))."""
        ids, n = torch.tensor([tokens]), torch.tensor([len(tokens)])
        if layers:
            return forward_layers(target, cache, slot, ids, n, layers)[::2]
        return forward(target, cache, slot, ids, n, return_hidden=True)

    logits, hidden = verify(prompt)
    out = [int(logits[0, -1].argmax())]
    stats = {"steps": 0, "tried": [0] * k, "accepted": [0] * k}
    if k:
        head_cache = new_cache(head, 1, length)
        head_slot = torch.tensor([head_cache.allocate()])
        feats, pair_tokens = hidden.to(torch.bfloat16), torch.tensor([prompt[1:] + out])
    while len(out) < max_new and out[-1] not in eos_ids:
        stats["steps"] += 1
        if not k:
            logits = forward(target, cache, slot, torch.tensor([[out[-1]]]), torch.tensor([1]))
            out.append(int(logits[0, -1].argmax()))
            continue
        drafts, _ = draft_chain(head, head_cache, head_slot, feats, pair_tokens, torch.tensor([feats.shape[1]]), k)
        drafts = drafts[0].tolist()
        logits, hidden = verify([out[-1]] + drafts)
        greedy = logits[0].argmax(-1).tolist()                          # (k + 1,)
        j = 0
        while j < k and drafts[j] == greedy[j]:
            j += 1
        for i in range(min(j + 1, k)):
            stats["tried"][i] += 1
            stats["accepted"][i] += int(i < j)
        emitted = drafts[:j] + [greedy[j]]
        cache.truncate(int(slot), int(cache.lengths[int(slot)]) - (k - j))
        feats, pair_tokens = hidden[:, :j + 1].to(torch.bfloat16), torch.tensor([emitted])
        for t in emitted:
            out.append(t)
            if t in eos_ids or len(out) == max_new:
                break
    return out, stats


# Checkpoints and runs are compared on "select": the last SELECT_CONVS conversations of the train
# split, which `features` (file order) reaches only after all the others; the held-out tenth is
# for reported figures alone.
SELECT_CONVS = 2000


def sharegpt_prompts(tokenizer, count: int, max_prompt: int, seed: int = SEED,
                     split: str = "held_out") -> list[list[int]]:
    """The first human turn of `count` ShareGPT conversations of `split` ("held_out", never trained
    on, or "select", see SELECT_CONVS) in a seeded shuffle, in the chat template, at most
    max_prompt tokens: what `specbus bench serve` sends."""
    from services.commands.bench_serve_core import first_exchange

    conversations = (load_sharegpt(split="held_out") if split == "held_out"
                     else load_sharegpt(split="train")[-SELECT_CONVS:])
    prompts = []
    for i in random.Random(seed).sample(range(len(conversations)), len(conversations)):
        exchange = first_exchange(conversations[i])
        if exchange is None or not exchange[0].strip():
            continue
        ids = tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": exchange[0]}]))
        if len(ids) <= max_prompt:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def evaluate(target: Path, head_dir: Path, prompts_count: int, max_new: int, k: int, max_prompt: int,
             device: str, split: str = "held_out") -> dict:
    """ShareGPT prompts of `split` (sharegpt_prompts), greedy, batch 1: acceptance per draft
    position, tokens per target step, the wall-time ratio k vs k=0, and whether both emitted the
    same token ids."""
    from gpu_worker.runtime.eagle import load_head

    tokenizer = load_tokenizer(target)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tconfig = load_model(target, device=device, dtype=dtype, max_seq_len=max_prompt + max_new + k + 2)
    head = load_head(head_dir, model, max_seq_len=max_prompt + max_new + k + 2)
    prompts = sharegpt_prompts(tokenizer, prompts_count, max_prompt, split=split)
    eos = tuple(tokenizer.eos_ids)
    totals = {"tokens": 0, "steps": 0, "tried": [0] * k, "accepted": [0] * k, "k_s": 0.0, "base_s": 0.0}
    same = 0
    for prompt in tqdm(prompts, desc="eval", unit="prompt"):
        t0 = time.perf_counter()
        spec, stats = speculative_greedy(model, tconfig, head, prompt, max_new, k, eos)
        t1 = time.perf_counter()
        base, _ = speculative_greedy(model, tconfig, head, prompt, max_new, 0, eos)
        t2 = time.perf_counter()
        same += spec == base
        totals["tokens"] += len(spec) - 1  # the first token comes from the prefill
        totals["steps"] += stats["steps"]
        totals["tried"] = [a + b for a, b in zip(totals["tried"], stats["tried"])]
        totals["accepted"] = [a + b for a, b in zip(totals["accepted"], stats["accepted"])]
        totals["k_s"] += t1 - t0
        totals["base_s"] += t2 - t1
    result = {
        "split": split, "prompts": len(prompts), "max_new_tokens": max_new, "k": k, "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."), "greedy_identical_to_k0": f"{same}/{len(prompts)}",
        "tokens_per_target_step": round(totals["tokens"] / max(1, totals["steps"]), 3),
        "acceptance_per_position": [round(a / max(1, t), 3) for a, t in zip(totals["accepted"], totals["tried"])],
        "speed_ratio_vs_k0": round(totals["base_s"] / max(1e-9, totals["k_s"]), 3),
        "k_tokens_per_s": round(totals["tokens"] / max(1e-9, totals["k_s"]), 2),
        "k0_tokens_per_s": round(totals["tokens"] / max(1e-9, totals["base_s"]), 2),
    }
    print(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["features", "train", "accumulate", "eval"])
    parser.add_argument("--target", type=Path, default=Path(default_target_model()))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument("--max-len", type=int, default=512, help="features: tokens per conversation")
    parser.add_argument("--shard-convs", type=int, default=32)
    parser.add_argument("--max-convs", type=int, default=0, help="features: conversations (0: all)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=4, help="train: conversations per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--unroll", type=int, default=4, help="train, accumulate: chain steps trained (1 = EAGLE-1)")
    parser.add_argument("--reg-weight", type=float, default=1.0, help="train: weight of the feature regression")
    parser.add_argument("--init-layer", type=int, default=None, help="train: start the layer from this target layer")
    parser.add_argument("--vocab-convs", type=int, default=1000,
                        help="train: train conversations whose token counts rank the head's vocabulary")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--tokens", type=int, default=2_000_000, help="accumulate: new training tokens this run")
    parser.add_argument("--replay", type=float, default=0.0,
                        help="accumulate: replayed conversations (of the shards just before) per new one")
    parser.add_argument("--state", type=Path, default=None, help="accumulate: the checkpoint dir (default: state_home)")
    parser.add_argument("--fresh", action="store_true", help="accumulate without a checkpoint: a new head")
    parser.add_argument("--out", type=Path, default=OUT, help="accumulate: where the head is exported")
    parser.add_argument("--data", type=Path, default=None,
                        help="accumulate: a regenerated-answers file (ops/train/regenerate_answers.py), not ShareGPT's")
    parser.add_argument("--init-head", type=Path, default=None,
                        help="accumulate, no checkpoint yet: start from this head directory (else a fresh head)")
    parser.add_argument("--init-convs", type=int, default=0,
                        help="accumulate: conversations of the seeded order that --init-head was trained on")
    parser.add_argument("--save-every", type=float, default=300.0, help="accumulate: seconds between checkpoints")
    parser.add_argument("--follow", action="store_true", help="train: read new feature shards at every pass")
    parser.add_argument("--head", type=Path, default=OUT, help="eval: the head directory")
    parser.add_argument("--prompts", type=int, default=20, help="eval: held-out ShareGPT prompts")
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("-k", type=int, default=4, help="eval: draft tokens per step")
    parser.add_argument("--split", choices=["held_out", "select"], default="held_out",
                        help="eval: held-out figures, or train conversations kept for comparing runs")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stage in ("features", "accumulate"):
        # Prefill is hundreds of rows a call: oneDNN's GEMM (AMX in bf16) rather than the fixed-order
        # kernel, a GEMV per row whose row-invariance serving needs and training does not. Read at
        # the first model load of the process (gpu_worker/runtime/linear_kernel.py).
        os.environ.setdefault("SPECBUS_LINEAR_KERNEL", "0")
    if args.stage == "features":
        extract_features(args.target, args.max_len, args.shard_convs, args.max_convs, args.device)
    elif args.stage == "train":
        train(args.target, args.steps, args.batch, args.lr, args.unroll, args.reg_weight, args.init_layer,
              args.resume, args.follow, args.device, vocab_text_convs=args.vocab_convs)
    elif args.stage == "accumulate":
        stop = threading.Event()  # SIGINT / SIGTERM: finish the step, save, exit
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        state, init_head, init_convs = accumulate_start(args.state, args.init_head, args.init_convs, args.fresh, OUT)
        accumulate(args.target, args.tokens, args.batch, args.lr, args.unroll, args.reg_weight, args.replay,
                   args.device, state, init_head, init_convs, args.shard_convs, args.max_len,
                   args.vocab_convs, args.save_every, stop.is_set, out=args.out,
                   exclude=frozenset(c["id"] for c in load_sharegpt(split="train")[-SELECT_CONVS:]), data=args.data)
    elif args.stage == "eval":
        result = evaluate(args.target, args.head, args.prompts, args.max_new, args.k, args.max_prompt, args.device,
                          args.split)
        if args.head == OUT and args.split == "held_out":
            (OUT / "eval.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
