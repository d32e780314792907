"""EAGLE-3's fused features measured against the last layer's, at equal training tokens (the
EAGLE head, gpu_worker/runtime/eagle.py, with EagleConfig.feature_layers: it reads the residual
streams entering a low, a middle and a high layer of the target, each rms-normed and projected
3E -> E, instead of the final-normed last hidden state).

    python ops/train/eagle_fused.py features --data FILE --tokens 400000           # both inputs, the same conversations
    python ops/train/eagle_fused.py train --data FILE --features fused --out DIR   # a fresh head on either input
    python ops/train/eagle_fused.py agree --data FILE --head DIR                    # teacher-forced, held-out shards
    python ops/train/train_eagle.py eval --split select --head DIR                  # in-process speculation, either head

`features` prefills the answers file's shards (FILE: ops/train/regenerate_answers.py's, as `train_eagle.py
accumulate --data` reads it) into $SPECBUS_HOME/eagle-data/fused-<stem of FILE>: per conversation
the final-normed last hidden state and the streams entering layers 2, N/2 and N-3
(`fused_layer_choice`); the file's last --held-out-shards shards are never trained on. `train
--features last|fused` trains a fresh head (the same seed, batches and recipe as `accumulate`'s,
the shipped head's vocabulary) on one of the two inputs; a fused head predicts no feature (there
is no single one), so its loss is the cross-entropy alone, and at chain steps >= 2 it reads its
own output in place of the projected input, as the last-layer head does. `agree` scores a head's
teacher-forced top-1 agreement with the target per chain step on the held-out shards.
Figures and commands: models/README.md "Fused features".
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from gpu_worker.batching.slots import resolve_dtype
from gpu_worker.runtime.checkpoint import load_d2t, read_config
from gpu_worker.runtime.eagle import EagleConfig, load_head_weights, weight_names
from gpu_worker.runtime.model import forward_layers
from schemas.config import default_target_model
from services.commands.bench_serve_core import load_sharegpt
from text.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle_training import (BETAS, OUT_SCALES, batch_tensors, chain_losses, init_weights, load_shards,  # noqa: E402
                             regenerated_shards, round_plan, write_shard)
from train_eagle import (OUT, SEED, SELECT_CONVS, WARMUP, data_dir, encode_conversation, export,  # noqa: E402
                         prefill_target, shard_path, target_weights)


def fused_layer_choice(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's layers for a num_layers-layer target: the residual stream entering layers 2,
    num_layers // 2 and num_layers - 3 (its code keeps the hidden state before running those
    layers), i.e. the outputs of layers 1, num_layers // 2 - 1 and num_layers - 4 (0-based)."""
    return (2, num_layers // 2, num_layers - 3)


def fused_dir(data: Path) -> Path:
    return data_dir() / f"fused-{Path(data).stem}"


def fused_shard_path(n: int, directory: Path) -> Path:
    return directory / f"fused-{n:04d}.safetensors"


def file_shards(data: Path, shard_convs: int) -> tuple[list[int], callable]:
    """(the shard numbers the answers file holds whole, in order; shard n -> its conversations)."""
    shard = regenerated_shards(data, shard_convs)
    first = min(c["position"] for c in json.loads(Path(data).read_text())["conversations"]) // shard_convs
    numbers = []
    while shard(first + len(numbers)) is not None:
        numbers.append(first + len(numbers))
    return numbers, shard


def split_shards(numbers: list[int], held_out: int) -> tuple[list[int], list[int]]:
    """(training shards, held-out shards): the file's last `held_out` shards are never trained on."""
    return numbers[:-held_out], numbers[-held_out:]


@torch.inference_mode()
def prefill_fused(target: Path, data: Path, goal_tokens: int, held_out: int, shard_convs: int, max_len: int,
                  device: str, exclude: frozenset[str]) -> None:
    """Shards of the answers file `data` in fused_dir(data): feat-NNNN (the final-normed last
    hidden state (T, E), what `accumulate` trains on) and fused-NNNN (fused_layer_choice's layers
    (T, 3E), under the key "features"), both bf16, the conversations and ids alike. The held-out
    shards first, then training shards in order until goal_tokens; shards on disk are skipped."""
    directory = fused_dir(data)
    numbers, shard = file_shards(data, shard_convs)
    train_shards, held = split_shards(numbers, held_out)
    tokenizer = load_tokenizer(target)
    model, config, cache = prefill_target(target, max_len, device)
    layers = fused_layer_choice(config.num_layers)
    print(f"layers {layers}; held out {held}; training from {train_shards[0]}", flush=True)
    done, t0, new_tokens = 0, time.time(), 0
    for n in held + train_shards:
        if n in train_shards and done >= goal_tokens:
            break
        if fused_shard_path(n, directory).exists():
            if n in train_shards:
                done += sum(len(r["ids"]) for r in load_shards([shard_path(n, directory)]))
            continue
        last, fused = [], []
        for conversation in shard(n):
            encoded = None if conversation["id"] in exclude else encode_conversation(tokenizer, conversation, max_len)
            if encoded is None:
                continue
            ids, start = encoded
            slot = cache.allocate()
            try:
                _, hidden, kept = forward_layers(model, cache, torch.tensor([slot]), torch.tensor([ids]),
                                                torch.tensor([len(ids)]), layers)
            finally:
                cache.free(slot)
            row = {"id": conversation["id"], "start": start, "ids": torch.tensor(ids)}
            last.append(dict(row, features=hidden[0].to(torch.bfloat16).cpu()))
            fused.append(dict(row, features=kept[0].to(torch.bfloat16).cpu()))
        write_shard(shard_path(n, directory), last)
        write_shard(fused_shard_path(n, directory), fused)  # written second: its presence marks the pair whole
        tokens = sum(len(r["ids"]) for r in last)
        new_tokens += tokens
        done += tokens if n in train_shards else 0
        print(f"{time.strftime('%H:%M:%S')} shard {n}: {len(last)} conversations, {tokens} tokens; training tokens "
              f"{done}; prefill {new_tokens / (time.time() - t0):.0f} tokens/s", flush=True)


def fused_config(target_config, features: str) -> EagleConfig:
    """The head's config for `--features last` (what `accumulate` trains) or `fused`."""
    config = EagleConfig.from_target(target_config)
    if features == "last":
        return config
    return dataclasses.replace(config, feature_layers=fused_layer_choice(target_config.num_layers))


def fused_init(config: EagleConfig, tw: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Fresh float32 weights: init_weights(seed) for every tensor both kinds share (so a last and a
    fused head start alike there), then a fused head's projection from its own generator."""
    weights = init_weights(config, tw, seed=seed)
    if config.feature_layers:
        E, F_ = config.hidden_size, len(config.feature_layers)
        g = torch.Generator().manual_seed(seed + 1)
        weights["fuse_norm"] = torch.ones(F_ * E)
        weights["fuse.weight"] = torch.randn(E, F_ * E, generator=g) * (F_ * E) ** -0.5
    return weights


def head_input(weights, config: EagleConfig, feats: torch.Tensor, inputs: torch.Tensor | None) -> torch.Tensor:
    """The chain's first-step input (B, T, E): the target's final-normed features feats, or for a
    fused head its projection of the fused layers inputs (B, T, F*E), each layer rms-normed
    first (their scales differ by depth), as `eagle.head_forward` does."""
    if inputs is None:
        return feats
    B, T, width = inputs.shape
    E = config.hidden_size
    parts = torch.nn.functional.rms_norm(inputs.view(B, T, width // E, E), (E,), eps=config.rms_norm_eps)
    parts = parts * weights["fuse_norm"].view(width // E, E)
    return torch.nn.functional.linear(parts.flatten(2), weights["fuse.weight"])


def padded_inputs(rows: list[dict], device: str) -> torch.Tensor | None:
    """Right-padded (B, T, F*E) float32 fused layers of rows (their "inputs"), or None for rows of a last-feature head."""
    if "inputs" not in rows[0]:
        return None
    T = max(len(r["ids"]) for r in rows)
    inputs = torch.zeros(len(rows), T, rows[0]["inputs"].shape[1])
    for b, r in enumerate(rows):
        inputs[b, :len(r["ids"])] = r["inputs"].float()
    return inputs.to(device)


def fused_chain_losses(weights, config, embed, lm_rows, other_id: int, ids, feats, inputs, lengths, starts,
                       steps: int, out_scale: float = 1.0):
    """eagle_training.chain_losses with the chain's first input head_input(...) rather than feats:
    per chain step j, (smooth L1 of the prediction against f_{t+j}, cross-entropy against the
    target's distribution (feats times lm_rows), top-1 agreement, positions). feats (B, T, E) is
    the teacher whatever the head reads; inputs (B, T, F*E) or None."""
    return chain_losses(weights, config, embed, lm_rows, other_id, ids, feats, lengths, starts, steps, out_scale,
                        first_input=head_input(weights, config, feats, inputs))


def fused_batch(rows: list[dict], device: str) -> tuple:
    """(ids, feats, inputs, lengths, starts) of rows, as fused_chain_losses takes them."""
    ids, feats, lengths, starts = batch_tensors(rows, device)
    return ids, feats, padded_inputs(rows, device), lengths, starts


def fused_rows(directory: Path, n: int, features: str) -> list[dict]:
    """Shard n's conversations: "features" the final-normed last layer (the teacher, and a last
    head's input), plus for a fused head "inputs", the fused layers (T, F*E)."""
    rows = load_shards([shard_path(n, directory)])
    if features == "fused":
        fused = {r["id"]: r["features"] for r in load_shards([fused_shard_path(n, directory)])}
        rows = [dict(r, inputs=fused[r["id"]]) for r in rows]
    return rows


def train_fused(target: Path, data: Path, features: str, goal_tokens: int, batch: int, lr: float, unroll: int,
                held_out: int, shard_convs: int, device: str, out: Path, vocab_head: Path = OUT) -> dict:
    """A fresh head (seed SEED) reading `features` ("last" or "fused"), one pass over the answers
    file's training shards (prefill_fused) in accumulate's batches (round_plan, no replay) until
    goal_tokens: accumulate's recipe (chain steps weighted 0.8^(j-1), AdamW BETAS, WARMUP steps of
    warmup then lr, gradient norm clipped at 0.5, bf16 autocast where the CPU has native bf16).
    A last head's loss adds the smooth L1 of its predicted features (weight 1, as accumulate); a
    fused head predicts no feature and has the cross-entropy alone. The vocabulary is vocab_head's
    (the shipped head's by default), for both kinds alike. Writes the head to out, with train.json."""
    torch.manual_seed(SEED)
    directory = fused_dir(data)
    train_shards, _ = split_shards(file_shards(data, shard_convs)[0], held_out)
    tw = target_weights(target)
    config = fused_config(read_config(target), features)
    embed = tw["embed"].to(device)
    maps = load_d2t(vocab_head)
    lm_rows = embed[maps.d2t.to(device)]
    weights = {n: t.to(device) for n, t in fused_init(config, tw, SEED).items()}
    reg_weight = 0.0 if config.feature_layers else 1.0
    bf16 = resolve_dtype("auto", device) == torch.bfloat16
    opt, ema, tokens, steps, t0, cpu0 = None, {}, 0, 0, time.time(), time.process_time()
    print(f"{features}: layers {list(config.feature_layers)}; unroll {unroll}, lr {lr}, batch {batch}, "
          f"bf16 {bf16}, goal {goal_tokens} tokens", flush=True)
    for n in train_shards:
        if tokens >= goal_tokens:
            break
        if not fused_shard_path(n, directory).exists():
            print(f"shard {n} not prefilled: stopping at {tokens} tokens", flush=True)
            break
        rows = fused_rows(directory, n, features)
        if opt is None:  # out_norm calibrated on the first batch, as accumulate's fresh head
            with torch.no_grad():
                first = fused_batch(rows[:batch], device)
                losses = {s: fused_chain_losses(weights, config, embed, lm_rows, maps.other_id, *first, steps=1,
                                                out_scale=s)[0][1].item() for s in OUT_SCALES}
                weights["out_norm"].mul_(min(losses, key=losses.get))
            print(f"out_norm scaled by {min(losses, key=losses.get)}", flush=True)
            weights = {k: t.requires_grad_(True) for k, t in weights.items()}
            opt = torch.optim.AdamW([weights[k] for k in weight_names(config)], lr=lr, betas=BETAS, weight_decay=0.0)
        for group_rows in round_plan(SEED, n, rows, [], 0.0, batch):
            if tokens >= goal_tokens:
                break
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (steps + 1) / WARMUP)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                parts = fused_chain_losses(weights, config, embed, lm_rows, maps.other_id,
                                           *fused_batch(group_rows, device), steps=unroll)
                loss = sum(0.8 ** j * (reg_weight * reg + ce) for j, (reg, ce, _, _) in enumerate(parts))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([weights[k] for k in weight_names(config)], 0.5)
            opt.step()
            steps += 1
            tokens += sum(len(r["ids"]) for r in group_rows)
            for j, (_, ce, agree, _) in enumerate(parts, start=1):
                for name, value in ((f"ce{j}", ce.item()), (f"acc{j}", agree.item())):
                    ema[name] = value if name not in ema else 0.95 * ema[name] + 0.05 * value
            if steps % 20 == 0:
                print(f"{time.strftime('%H:%M:%S')} step {steps} shard {n} tokens {tokens} "
                      f"({tokens / (time.time() - t0):.0f}/s) " + " ".join(f"{k}={v:.3f}" for k, v in ema.items()),
                      flush=True)
    export(target, config, {k: t.detach().cpu() for k, t in weights.items()}, maps, out)
    wall = time.time() - t0
    result = {"features": features, "feature_layers": list(config.feature_layers), "tokens": tokens, "steps": steps,
              "wall_s": round(wall, 1), "tokens_per_s": round(tokens / wall, 1),
              "cpu_s": round(time.process_time() - cpu0, 1), "unroll": unroll, "lr": lr,
              "batch": batch, "bf16": bf16, "ema": {k: round(v, 4) for k, v in ema.items()}}
    (out / "train.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return result


@torch.no_grad()
def fused_agreement(target: Path, data: Path, head_dir: Path, steps: int, held_out: int, shard_convs: int,
                    batch: int, device: str) -> dict:
    """Teacher-forced top-1 agreement with the target per chain step 1..steps over the answers
    file's held-out shards (never trained on), float32: counts over every labelled position."""
    config, weights, maps = load_head_weights(head_dir)
    directory = fused_dir(data)
    _, held = split_shards(file_shards(data, shard_convs)[0], held_out)
    embed = target_weights(target)["embed"].to(device)
    lm_rows = embed[maps.d2t.to(device)]
    weights = {n: t.to(device) for n, t in weights.items()}
    features = "fused" if config.feature_layers else "last"
    agree, positions, ce = [0.0] * steps, [0] * steps, [0.0] * steps
    for n in held:
        rows = fused_rows(directory, n, features)
        for i in range(0, len(rows), batch):
            parts = fused_chain_losses(weights, config, embed, lm_rows, maps.other_id,
                                       *fused_batch(rows[i:i + batch], device), steps=steps)
            for j, (_, c, a, m) in enumerate(parts):
                agree[j] += a.item() * m
                ce[j] += c.item() * m
                positions[j] += m
    result = {"head": str(head_dir), "features": features, "held_out_shards": held, "positions": positions,
              "agreement": [round(a / max(1, m), 4) for a, m in zip(agree, positions)],
              "cross_entropy": [round(c / max(1, m), 4) for c, m in zip(ce, positions)]}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["features", "train", "agree"])
    parser.add_argument("--target", type=Path, default=Path(default_target_model()))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument("--data", type=Path, required=True, help="the answers file (ops/train/regenerate_answers.py)")
    parser.add_argument("--tokens", type=int, default=400_000, help="features, train: training tokens")
    parser.add_argument("--held-out-shards", type=int, default=5,
                        help="the answers file's last shards, never trained on (agree scores them)")
    parser.add_argument("--features", choices=["last", "fused"], default="last",
                        help="train: the head reads the target's final-normed last layer, or three fused layers")
    parser.add_argument("--max-len", type=int, default=512, help="features: tokens per conversation")
    parser.add_argument("--shard-convs", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--unroll", type=int, default=4, help="train, agree: chain steps")
    parser.add_argument("--out", type=Path, default=None, help="train: the head directory written")
    parser.add_argument("--head", type=Path, default=None, help="agree: the head directory scored")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stage == "features":
        # prefill: oneDNN's GEMM, as train_eagle.py's features stage (read at the first model load)
        os.environ.setdefault("SPECBUS_LINEAR_KERNEL", "0")
        prefill_fused(args.target, args.data, args.tokens, args.held_out_shards, args.shard_convs, args.max_len,
                      args.device, frozenset(c["id"] for c in load_sharegpt(split="train")[-SELECT_CONVS:]))
    elif args.stage == "train":
        train_fused(args.target, args.data, args.features, args.tokens, args.batch, args.lr, args.unroll,
                    args.held_out_shards, args.shard_convs, args.device, args.out)
    else:
        result = fused_agreement(args.target, args.data, args.head, args.unroll, args.held_out_shards,
                                 args.shard_convs, args.batch, args.device)
        (args.head / "agree.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
