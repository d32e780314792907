"""Training-only code of the EAGLE head (ops/train_eagle.py): fresh weights, saving a head
directory, and the unrolled training forward. The runtime half (loading, `head_forward`,
`draft_chain`) is gpu_worker/runtime/eagle.py."""

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from gpu_worker.runtime.checkpoint import D2T, save_d2t
from gpu_worker.runtime.eagle import CONFIG_FILE, LAYER_NAMES, WEIGHTS_FILE, EagleConfig, weight_names
from gpu_worker.runtime.model import rope_tables


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
    save_file({n: weights[n].detach().to(torch.bfloat16).contiguous() for n in weight_names()},
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
