"""Train the EAGLE-style feature-level draft for SmolLM2-135M-Instruct (models/smollm2-eagle).

    python ops/train_eagle.py features --threads 1    # target features of ShareGPT train conversations
    python ops/train_eagle.py train --threads 1 --follow   # train the head (--resume continues)
    python ops/train_eagle.py eval --threads 1        # held-out ShareGPT: acceptance, speed, lossless

--target DIR: the HF-layout directory of the target (default: where `specbus models pull` puts
it). Features go to $SPECBUS_HOME/eagle-data (shards of --shard-convs conversations, kept: an
interrupted run resumes at the next missing shard); checkpoints to .train/smollm2-eagle/; the head
is exported to models/smollm2-eagle/ at every checkpoint. `--device cuda` runs any stage on a GPU.

Design (gpu_worker/runtime/eagle.py has the head):
- Data: ShareGPT's train split only (services/commands/bench_serve_core.load_sharegpt; the
  held-out tenth, sha1(id) % 10 == 0, is for `eval` alone), every conversation rendered with the
  target's chat template (its default system prompt, as `specbus generate --chat` sends it),
  cut to --max-len tokens. Teacher-forced prefill with specbus's own runtime
  (gpu_worker.runtime.model.forward(return_hidden=True)), so the features are the bits a verifier
  returns: per position the final-normed hidden state (bf16, what the serving path ships) and the
  token id. The target's next-token distribution is those features times its lm_head.
- Loss per position after the system prompt: smooth L1 between the predicted and the target's
  next feature (EAGLE-1) plus cross-entropy of the head's distribution against the target's (both over the
  reduced vocabulary d2t), also at the steps of a chain where the
  head reads its own predicted features (`--unroll`): what it does when drafting k > 1 tokens.
"""

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from text.chat_template import render_chat
from gpu_worker.runtime.checkpoint import D2T, load_model, our_name, read_config, weight_files
from gpu_worker.runtime.eagle import EagleConfig
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from text.tokenizer import load_tokenizer
from schemas.config import default_target_model, specbus_home
from services.commands.bench_serve_core import load_sharegpt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_draft import COPIED_FILES, DRAFT_VOCAB  # noqa: E402
from eagle_training import init_weights, save_head, unrolled_forward  # noqa: E402
from train_models import lr_at  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "models" / "smollm2-eagle"
WORK = REPO / ".train" / "smollm2-eagle"
SEED = 1234
OUT_SCALES = (1.0, 0.5, 0.35, 0.25, 0.18, 0.125, 0.09)
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
    prompt before it."""
    messages = chat_messages(conversation)
    if not messages:
        return None
    ids = tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt=False))[:max_len]
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


def extract_features(target: Path, max_len: int, shard_convs: int, max_convs: int, device: str) -> None:
    """Shards data_dir()/feat-NNNN.safetensors of shard_convs train conversations each (a seeded
    shuffle, so any prefix of shards is a random sample); existing shards are skipped."""
    tokenizer = load_tokenizer(target)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, config = load_model(target, device=device, dtype=dtype, max_seq_len=max_len)
    cache = KVCache(config, max_slots=1, max_seq_len=max_len, device=device, dtype=dtype)
    conversations = load_sharegpt(split="train")
    order = random.Random(SEED).sample(range(len(conversations)), len(conversations))[:max_convs or None]
    out = data_dir()
    out.mkdir(parents=True, exist_ok=True)
    shards = [order[i:i + shard_convs] for i in range(0, len(order), shard_convs)]
    done_tokens, t0 = 0, time.time()
    bar = tqdm(shards, desc="features", unit="shard")
    for n, indices in enumerate(bar):
        path = out / f"feat-{n:04d}.safetensors"
        if path.exists():
            continue
        rows = []
        for i in indices:
            encoded = encode_conversation(tokenizer, conversations[i], max_len)
            if encoded is None:
                continue
            ids, start = encoded
            rows.append({"id": conversations[i]["id"], "start": start, "ids": torch.tensor(ids),
                         "features": conversation_features(model, config, cache, ids, device)})
            done_tokens += len(ids)
            bar.set_postfix(tok_s=f"{done_tokens / (time.time() - t0):.0f}", tokens=done_tokens)
        write_shard(path, rows)


def write_shard(path: Path, rows: list[dict]) -> None:
    """One shard of conversations {"id", "start", "ids" (T,), "features" (T, E) bf16}; written
    to a temporary name and renamed, so a shard exists only whole."""
    tensors, meta = {}, []
    for r in rows:
        tensors[f"{r['id']}.ids"] = r["ids"].to(torch.int32)
        tensors[f"{r['id']}.features"] = r["features"].to(torch.bfloat16).contiguous()
        meta.append({"id": r["id"], "start": r["start"], "len": len(r["ids"])})
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"rows": json.dumps(meta)})
    tmp.rename(path)


def load_shards(paths: list[Path]) -> list[dict]:
    """Conversations of the given feature shards: dicts of ids (T,), features (T, E) bf16,
    start (where the loss starts), len, id."""
    rows = []
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for row in json.loads(f.metadata()["rows"]):
                key = row["id"]
                rows.append(dict(row, ids=f.get_tensor(f"{key}.ids").long(),
                                 features=f.get_tensor(f"{key}.features")))
    return rows


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
    order = random.Random(SEED).sample(range(len(train_split)), len(train_split))[:conversations]
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


def batch_tensors(rows: list[dict], device: str):
    """Right-padded (B, T) ids, (B, T, E) float32 features, (B,) lengths and loss starts."""
    T = max(len(r["ids"]) for r in rows)
    E = rows[0]["features"].shape[1]
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    feats = torch.zeros(len(rows), T, E)
    for b, r in enumerate(rows):
        ids[b, :len(r["ids"])] = r["ids"]
        feats[b, :len(r["ids"])] = r["features"].float()
    lengths = torch.tensor([len(r["ids"]) for r in rows])
    starts = torch.tensor([r["start"] for r in rows])
    return ids.to(device), feats.to(device), lengths.to(device), starts.to(device)


def chain_losses(weights, config, embed, lm_rows, other_id: int, ids, feats, lengths, starts, steps: int,
                 out_scale: float = 1.0):
    """Per chain step j: (smooth L1 of the predicted feature, cross-entropy against the target's
    distribution over the draft vocabulary, top-1 agreement, positions), averaged over the
    positions whose target feature f_{t+j} exists and lies at or after the row's loss start.
    out_scale multiplies the predictions (`calibrate_out_norm` tries a few)."""
    B, T, _ = feats.shape
    predictions = unrolled_forward(weights, config, embed, feats, ids, steps)
    position = torch.arange(T, device=feats.device).view(1, T)
    labelled = (position < lengths.view(B, 1)) & (position >= starts.view(B, 1))    # (B, T)
    with torch.no_grad():  # the target's distribution at every labelled position, once for all steps
        teacher_logits = feats[labelled] @ lm_rows.T
        teacher_logits[:, other_id] = -math.inf
        teacher = teacher_logits.softmax(-1)                                       # (L, Vd)
        teacher_top = teacher_logits.argmax(-1)
    row_of = torch.cumsum(labelled.flatten(), 0).view(B, T) - 1                    # (B, T) row in teacher
    out = []
    for j, predicted in enumerate(predictions, start=1):
        valid = F.pad(labelled[:, j:], (0, j - 1))                                 # (B, N): f_{t+j} labelled
        rows = F.pad(row_of[:, j:], (0, j - 1))[valid]
        true = F.pad(feats[:, j:], (0, 0, 0, j - 1))[valid]                        # (M, E)
        pred = predicted[valid] * out_scale
        logits = pred @ lm_rows.T
        logits[:, other_id] = -math.inf
        ce = -(teacher[rows] * logits.log_softmax(-1).clamp_min(-1e4)).sum(-1).mean()
        reg = F.smooth_l1_loss(pred, true)
        agree = (logits.argmax(-1) == teacher_top[rows]).float().mean()
        out.append((reg, ce, agree, int(valid.sum())))
    return out


@torch.no_grad()
def calibrate_out_norm(weights, config, embed, lm_rows, other_id: int, batch) -> None:
    """Scale the fresh head's out_norm (the target's final norm) by the factor in OUT_SCALES with
    the lowest step-1 cross-entropy on one batch: a random layer's output, normed with the
    target's weights, gives confidently wrong logits (~19 nats), and Adam would spend many of
    the few steps a CPU run has shrinking 576 weights."""
    losses = {scale: chain_losses(weights, config, embed, lm_rows, other_id, *batch, steps=1, out_scale=scale)[0][1].item()
              for scale in OUT_SCALES}
    best = min(losses, key=losses.get)
    weights["out_norm"].mul_(best)
    print(f"out_norm scaled by {best} (cross-entropy {losses[1.0]:.2f} -> {losses[best]:.2f})", flush=True)


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
        raise SystemExit(f"no feature shards in {data_dir()}: run `python ops/train_eagle.py features` first")
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
    step_weights = [0.8 ** j for j in range(unroll)]
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
        ids, feats, lengths, starts = batch_tensors([by_id[i] for i in picked], device)
        parts = chain_losses(weights, config, embed, lm_rows, maps.other_id, ids, feats, lengths, starts, unroll)
        loss = sum(w * (reg_weight * reg + ce) for w, (reg, ce, _, _) in zip(step_weights, parts))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(weights.values()), 0.5)
        opt.step()
        for j, (reg, ce, agree, _) in enumerate(parts, start=1):
            for name, value in ((f"ce{j}", ce.item()), (f"acc{j}", agree.item()), (f"reg{j}", reg.item())):
                ema[name] = value if name not in ema else 0.95 * ema[name] + 0.05 * value
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items() if not k.startswith("reg") or k == "reg1"},
                        convs=len(by_id))
        if time.time() - last_save > save_every_s or step + 1 == steps:
            state = {n: t.detach().cpu() for n, t in weights.items()}
            torch.save({"weights": state, "opt": opt.state_dict(), "rng": rng.getstate(), "step": step + 1,
                        "order": order, "maps": maps, "config": config}, ckpt_path)
            export(target, config, state, maps)
            bar.write(f"step {step + 1}: " + " ".join(f"{k}={v:.3f}" for k, v in ema.items()))
            last_save = time.time()


def export(target: Path, config: EagleConfig, weights: dict[str, torch.Tensor], maps: D2T) -> None:
    """models/smollm2-eagle: the head (bf16), d2t and the target's tokenizer files (a drafter
    pairs with a verifier only when the tokenizers hash the same)."""
    import shutil

    save_head(OUT, config, weights, maps)
    for name in COPIED_FILES:
        if (target / name).exists():
            shutil.copyfile(target / name, OUT / name)


# ---------------------------------------------------------------------------------------------
# eval: speculative greedy decoding in process, with the real target


@torch.inference_mode()
def speculative_greedy(target, tconfig, head, prompt: list[int], max_new: int, k: int,
                       eos_ids: tuple[int, ...]) -> tuple[list[int], dict]:
    """Greedy decoding of up to max_new tokens after prompt (stopping after an eos id): k = 0 is
    plain decoding, one target forward per token; k > 0 drafts k tokens with the head, verifies
    them in one target forward of k + 1 tokens and keeps the longest agreeing prefix plus the
    target's own next token. Features reach the head as bf16, as the serving path ships them.
    Returns (token ids, {"steps": target forwards after the prefill, "tried": (k,) drafts at each
    position that were verified, "accepted": (k,) of those accepted})."""
    from gpu_worker.runtime.eagle import draft_chain, new_cache

    length = len(prompt) + max_new + k + 1
    cache = KVCache(tconfig, max_slots=1, max_seq_len=length, device=target.embed.device, dtype=target.embed.dtype)
    slot = torch.tensor([cache.allocate()])
    P = len(prompt)
    logits, hidden = forward(target, cache, slot, torch.tensor([prompt]), torch.tensor([P]), return_hidden=True)
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
        tokens = torch.tensor([[out[-1]] + drafts])
        logits, hidden = forward(target, cache, slot, tokens, torch.tensor([k + 1]), return_hidden=True)
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
    parser.add_argument("stage", choices=["features", "train", "eval"])
    parser.add_argument("--target", type=Path, default=Path(default_target_model()))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument("--max-len", type=int, default=512, help="features: tokens per conversation")
    parser.add_argument("--shard-convs", type=int, default=32)
    parser.add_argument("--max-convs", type=int, default=0, help="features: conversations (0: all)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=4, help="train: conversations per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--unroll", type=int, default=2, help="train: chain steps trained (1 = EAGLE-1)")
    parser.add_argument("--reg-weight", type=float, default=1.0, help="train: weight of the feature regression")
    parser.add_argument("--init-layer", type=int, default=None, help="train: start the layer from this target layer")
    parser.add_argument("--vocab-convs", type=int, default=1000,
                        help="train: train conversations whose token counts rank the head's vocabulary")
    parser.add_argument("--resume", action="store_true")
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
    if args.stage == "features":
        extract_features(args.target, args.max_len, args.shard_convs, args.max_convs, args.device)
    elif args.stage == "train":
        train(args.target, args.steps, args.batch, args.lr, args.unroll, args.reg_weight, args.init_layer,
              args.resume, args.follow, args.device, vocab_text_convs=args.vocab_convs)
    elif args.stage == "eval":
        result = evaluate(args.target, args.head, args.prompts, args.max_new, args.k, args.max_prompt, args.device,
                          args.split)
        if args.head == OUT and args.split == "held_out":
            (OUT / "eval.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
