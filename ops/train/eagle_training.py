"""Training-only code of the EAGLE head (ops/train/train_eagle.py): fresh weights, saving a head
directory, the unrolled training forward, and the accumulating run's checkpoint (weights, what
it keeps of the optimizer, d2t, data position), feature shard files, and the shards of a
regenerated-answers file. The runtime half (loading, `head_forward`,
`draft_chain`) is gpu_worker/runtime/eagle.py."""

import json
import math
import random
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from gpu_worker.runtime.checkpoint import D2T, save_d2t
from gpu_worker.runtime.eagle import CONFIG_FILE, LAYER_NAMES, WEIGHTS_FILE, EagleConfig, weight_names
from gpu_worker.runtime.model import rope_tables
from schemas.config import specbus_home


def init_weights(config: EagleConfig, target_weights: dict[str, torch.Tensor] | None = None,
                 init_layer: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fresh float32 weights: fc small random (generator seeded), norms 1, out_norm the target's
    final norm when target_weights (our names, `model.weight_names`) is given, the decoder layer
    random or copied from target layer init_layer."""
    E, I, H, Hkv, D = (config.hidden_size, config.intermediate_size, config.num_heads,
                       config.num_kv_heads, config.head_dim)
    g = torch.Generator().manual_seed(seed)

    def rand(out, inp):
        return torch.randn(out, inp, generator=g) * inp ** -0.5 * 0.5

    w = {"fc.weight": rand(E, 2 * E), "fc.bias": torch.zeros(E), "feature_norm": torch.ones(E),
         "embed_norm": torch.ones(E), "out_norm": torch.ones(E),
         "layer.attn_norm": torch.ones(E), "layer.mlp_norm": torch.ones(E),
         "layer.wq": rand(H * D, E), "layer.wk": rand(Hkv * D, E), "layer.wv": rand(Hkv * D, E),
         "layer.wo": rand(E, H * D) * 0.5, "layer.w_gate": rand(I, E), "layer.w_up": rand(I, E),
         "layer.w_down": rand(E, I) * 0.5}
    if target_weights is not None:
        w["out_norm"] = target_weights["norm"].float().clone()
        if init_layer is not None:
            for n in LAYER_NAMES:
                w[f"layer.{n}"] = target_weights[f"layers.{init_layer}.{n}"].float().clone()
    return w


def save_head(path, config: EagleConfig, weights: dict[str, torch.Tensor], maps: D2T) -> None:
    """path/eagle_config.json, model.safetensors (bf16: the runtime converts at load),
    d2t.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps({"architecture": "EagleHead", **asdict(config)}, indent=2) + "\n")
    save_file({n: weights[n].detach().to(torch.bfloat16).contiguous() for n in weight_names(config)},
              str(path / WEIGHTS_FILE))
    save_d2t(path, maps.d2t, maps.t2d, maps.other_id)


def unrolled_forward(weights: dict[str, torch.Tensor], config: EagleConfig, embed: torch.Tensor,
                     features: torch.Tensor, token_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training forward over whole sequences, with the first `steps` steps of a draft chain.

    weights: `weight_names` tensors (trainable); embed: (V, E) the target's (frozen);
    features: (B, T, E) target features f_0..f_{T-1}; token_ids: (B, T) x_0..x_{T-1}. Returns,
    per step j = 1..steps, predictions P_j (B, N, E) with N = T - 1: row t of P_j predicts
    f_{t+j}. Step 1 at row t reads the pair (f_t, x_{t+1}) at position t; step j > 1 reads
    (P_{j-1}[t], x_{t+j}) at position t + j - 1, attending to step 1's keys at rows <= t and
    step i's key at row t for 2 <= i <= j: exactly the cache a chain's j-th draft sees after
    verified pairs up to t (EAGLE-3's "training-time test"). Rows whose inputs pass the end
    (t + j > T - 1) hold padding and must get no loss. Plain ops (autograd); `head_forward` is
    the inference form of the same math.
    """
    B, T, E = features.shape
    N = T - 1
    H, Hkv, D, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    G = H // Hkv
    w = weights
    cos_all, sin_all = rope_tables(config, T + steps)
    cos_all, sin_all = cos_all.to(features), sin_all.to(features)
    causal = torch.ones(N, N, dtype=torch.bool, device=features.device).tril()
    padded_ids = F.pad(token_ids, (0, steps))                         # x_{t+j} past the end: id 0
    keys, values, outputs = [], [], []
    feats = features[:, :N]
    for j in range(1, steps + 1):
        f = F.rms_norm(feats, (E,), w["feature_norm"], eps)
        e = F.rms_norm(embed[padded_ids[:, j:j + N]], (E,), w["embed_norm"], eps)
        x = F.linear(torch.cat([f, e], -1), w["fc.weight"], w["fc.bias"])           # (B, N, E)
        h = F.rms_norm(x, (E,), w["layer.attn_norm"], eps)
        q = F.linear(h, w["layer.wq"]).view(B, N, H, D)
        k = F.linear(h, w["layer.wk"]).view(B, N, Hkv, D)
        v = F.linear(h, w["layer.wv"]).view(B, N, Hkv, D).transpose(1, 2)           # (B, Hkv, N, D)
        cos, sin = cos_all[j - 1:j - 1 + N].view(1, N, 1, D), sin_all[j - 1:j - 1 + N].view(1, N, 1, D)
        q = (q * cos + q.roll(D // 2, -1) * sin).view(B, N, Hkv, G, D).permute(0, 2, 3, 1, 4)  # (B, Hkv, G, N, D)
        k = (k * cos + k.roll(D // 2, -1) * sin).transpose(1, 2)                     # (B, Hkv, N, D)
        keys.append(k)
        values.append(v)
        scale = D ** -0.5
        main = torch.einsum("bkgnd,bkmd->bkgnm", q, keys[0]) * scale
        main = main.masked_fill(~causal, float("-inf"))                              # (B, Hkv, G, N, N)
        diag = [torch.einsum("bkgnd,bknd->bkgn", q, keys[i]).unsqueeze(-1) * scale for i in range(1, j)]
        probs = torch.cat([main] + diag, -1).softmax(-1)
        o = probs[..., :N] @ values[0].unsqueeze(2)                                  # (B, Hkv, G, N, D)
        for i in range(1, j):
            o = o + probs[..., N + i - 1:N + i] * values[i].unsqueeze(2)
        o = o.permute(0, 3, 1, 2, 4).reshape(B, N, H * D)
        x = x + F.linear(o, w["layer.wo"])
        h = F.rms_norm(x, (E,), w["layer.mlp_norm"], eps)
        x = x + F.linear(F.silu(F.linear(h, w["layer.w_gate"])) * F.linear(h, w["layer.w_up"]), w["layer.w_down"])
        predicted = F.rms_norm(x, (E,), w["out_norm"], eps)
        outputs.append(predicted)
        feats = predicted
    return outputs


OUT_SCALES = (1.0, 0.5, 0.35, 0.25, 0.18, 0.125, 0.09)


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
                 out_scale: float = 1.0, first_input: torch.Tensor | None = None):
    """Per chain step j: (smooth L1 of the predicted feature, cross-entropy against the target's
    distribution over the draft vocabulary, top-1 agreement, positions), averaged over the
    positions whose target feature f_{t+j} exists and lies at or after the row's loss start.
    out_scale multiplies the predictions (`calibrate_out_norm` tries a few). first_input: what the
    chain's first step reads instead of feats (B, T, E) (a fused head's projected layers); feats
    stay the teacher."""
    B, T, _ = feats.shape
    predictions = unrolled_forward(weights, config, embed, feats if first_input is None else first_input, ids, steps)
    position = torch.arange(T, device=feats.device).view(1, T)
    labelled = (position < lengths.view(B, 1)) & (position >= starts.view(B, 1))    # (B, T)
    # the target's distribution at every labelled position, once for all steps, in float32 (also
    # under autocast: bf16 logits would move it by a tenth of a nat)
    with torch.no_grad(), torch.autocast(feats.device.type, enabled=False):
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


def train_step(weights, opt, config, embed, lm_rows, other_id: int, rows: list[dict], unroll: int,
               reg_weight: float, device: str, ema: dict, bf16_matmuls: bool = False) -> None:
    """One AdamW step on the conversations `rows`: chain step j's loss (reg_weight x smooth L1 +
    cross-entropy) weighted 0.8^(j-1), the gradient norm clipped at 0.5; `ema` (ce_j, acc_j,
    reg_j running averages) updated. bf16_matmuls: the head's forward under bf16 autocast (for
    a device with native bf16; weights, optimizer and the target's distribution stay float32)."""
    ids, feats, lengths, starts = batch_tensors(rows, device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16_matmuls):
        parts = chain_losses(weights, config, embed, lm_rows, other_id, ids, feats, lengths, starts, unroll)
        loss = sum(0.8 ** j * (reg_weight * reg + ce) for j, (reg, ce, _, _) in enumerate(parts))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(weights.values()), 0.5)
    opt.step()
    for j, (reg, ce, agree, _) in enumerate(parts, start=1):
        for name, value in ((f"ce{j}", ce.item()), (f"acc{j}", agree.item()), (f"reg{j}", reg.item())):
            ema[name] = value if name not in ema else 0.95 * ema[name] + 0.05 * value


def round_plan(seed: int, n: int, new: list[dict], pool: list[dict], replay: float, batch: int) -> list[list[dict]]:
    """The batches of shard n's round: its conversations `new` plus replay x as many drawn from
    `pool`, shuffled; a function of its arguments alone, so a resumed round repeats the plan."""
    g = random.Random(seed * 100_003 + n)
    rows = new + g.sample(pool, min(len(pool), round(replay * len(new))))
    rows = g.sample(rows, len(rows))
    return [rows[i:i + batch] for i in range(0, len(rows), batch)]


# ---------------------------------------------------------------------------------------------
# the accumulating run's checkpoint (ops/train/train_eagle.py `accumulate`), committed in the repository

STATE_FILE = "state.safetensors"
BETAS = (0.9, 0.95)
COUNTERS = ("step", "adam_step", "position", "round_step", "tokens", "shard_convs", "max_len")


def start_counters(position: int, tokens: int, shard_convs: int, max_len: int) -> dict:
    """COUNTERS of a head not yet trained here, which has consumed `position` conversations
    (`tokens` tokens) of the seeded order."""
    return {"step": 0, "adam_step": 0, "position": position, "round_step": 0, "tokens": tokens,
            "shard_convs": shard_convs, "max_len": max_len}


def new_optimizer(weights: dict[str, torch.Tensor], lr: float) -> torch.optim.AdamW:
    """AdamW over weights (in weight_names order), the betas every EAGLE run here uses."""
    return torch.optim.AdamW([weights[n] for n in weight_names()], lr=lr, betas=BETAS, weight_decay=0.0)


def save_state(path, weights: dict[str, torch.Tensor], opt: torch.optim.AdamW, maps: D2T, counters: dict) -> None:
    """path/STATE_FILE, written to a temporary name and renamed (a checkpoint exists only whole):
    the weights in float32, Adam's second moments in bf16 (a per-weight scale: bf16's 8 bits are
    plenty), the d2t maps, and `counters` (COUNTERS: optimizer steps, Adam's own step count, the
    data position in conversations of the seeded order, steps done in the current round, unique
    training tokens consumed, the shard size and token cut the position assumes) as metadata.
    Adam's first moments are left out: fp32 weights and both moments would pass the size the
    repository allows, and with beta1 = 0.9 a zero momentum is rebuilt within a few steps (the
    step count kept, the first updates are smaller, never larger). Then opt is set to what the
    file holds (restore_optimizer), so a run that goes on and one resumed from the file agree."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params = dict(zip(weight_names(), opt.param_groups[0]["params"]))
    tensors = {f"weight.{n}": weights[n].detach().float().cpu().contiguous() for n in weight_names()}
    for n, p in params.items():
        if "exp_avg_sq" in opt.state.get(p, {}):
            tensors[f"exp_avg_sq.{n}"] = opt.state[p]["exp_avg_sq"].to(torch.bfloat16).cpu().contiguous()
    tensors["d2t"], tensors["t2d"] = maps.d2t.contiguous(), maps.t2d.contiguous()
    meta = {"counters": json.dumps({k: int(counters[k]) for k in COUNTERS}), "other_id": str(maps.other_id)}
    tmp = path / (STATE_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path / STATE_FILE)
    restore_optimizer(opt, {n[len("exp_avg_sq."):]: t for n, t in tensors.items() if n.startswith("exp_avg_sq.")},
                      counters["adam_step"])


def load_state(path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], D2T, dict] | None:
    """(float32 weights, float32 second moments (empty before the first step), d2t maps,
    counters) of path/STATE_FILE, or None when there is none."""
    file = Path(path) / STATE_FILE
    if not file.exists():
        return None
    with safe_open(file, framework="pt") as f:
        meta = f.metadata()
        # cloned: safetensors hands out tensors at 8-byte offsets, and the bf16 matmuls' results
        # depend on alignment (a resumed run would drift from one that went on)
        weights = {n: f.get_tensor(f"weight.{n}").clone() for n in weight_names()}
        moments = {n: f.get_tensor(f"exp_avg_sq.{n}").float() for n in weight_names() if f"exp_avg_sq.{n}" in f.keys()}
        maps = D2T(f.get_tensor("d2t"), f.get_tensor("t2d"), int(meta["other_id"]))
    return weights, moments, maps, json.loads(meta["counters"])


def restore_optimizer(opt: torch.optim.AdamW, moments: dict[str, torch.Tensor], adam_step: int) -> None:
    """Set opt's state to what save_state keeps: second moments as given (bf16-rounded), first
    moments zero, Adam's step count adam_step. save_state ends with it, so a run that goes on in
    process and one resumed from the file take bit-identical steps."""
    state = {}
    for i, (n, p) in enumerate(zip(weight_names(), opt.param_groups[0]["params"])):
        if n in moments:
            state[i] = {"step": torch.tensor(float(adam_step)), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": moments[n].to(torch.bfloat16).to(p)}
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def write_shard(path: Path, rows: list[dict]) -> None:
    """One shard of conversations {"id", "start", "ids" (T,), "features" (T, E) bf16}; written
    to a temporary name and renamed, so a shard exists only whole."""
    tensors, meta = {}, []
    for r in rows:
        tensors[f"{r['id']}.ids"] = r["ids"].to(torch.int32)
        tensors[f"{r['id']}.features"] = r["features"].to(torch.bfloat16).contiguous()
        meta.append({"id": r["id"], "start": r["start"], "len": len(r["ids"])})
    tmp = path.with_suffix(".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
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


def regenerated_shards(path, shard_convs: int):
    """The shards of a regenerated-answers file (ops/train/regenerate_answers.py) as `accumulate` walks
    them: a function of the shard number n giving the file's conversations at positions
    n * shard_convs .. (n + 1) * shard_convs - 1 of the seeded train order (the ShareGPT shard n
    whose prompts they answer), or None for a shard the file does not cover whole yet."""
    data = json.loads(Path(path).read_text())
    by_shard: dict[int, list[dict]] = {}
    for conversation in data["conversations"]:
        by_shard.setdefault(conversation["position"] // shard_convs, []).append(conversation)
    complete = data["next_position"] // shard_convs  # shards before this one are whole
    return lambda n: by_shard.get(n, []) if n < complete else None


# the data position of the served head: the conversations its last checkpoint had consumed
SERVED_CONVS = 8576


def state_home() -> Path:
    """Where `accumulate` keeps its checkpoint by default: training state is not served, so it
    lives under $SPECBUS_HOME (read when called), never in models/."""
    return specbus_home() / "train" / "smollm2-eagle"


def accumulate_start(state: Path | None, init_head: Path | None, init_convs: int, fresh: bool,
                     served: Path) -> tuple[Path, Path | None, int]:
    """(checkpoint directory, head to seed from, its conversations) for `accumulate` from the
    command line: the checkpoint in state (default state_home()) when there is one; else
    init_head if given, else the served head at SERVED_CONVS unless fresh (then a new head)."""
    state = state_home() if state is None else state
    if load_state(state) is not None or init_head is not None or fresh:
        return state, init_head, init_convs
    print(f"no checkpoint in {state}: starting from the served head {served} at {SERVED_CONVS} conversations "
          f"(a fresh optimizer; --fresh for a new head)", flush=True)
    return state, served, SERVED_CONVS
