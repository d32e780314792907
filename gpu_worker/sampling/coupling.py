"""Drafter-invariant sampling: Gumbel-max coupling of the draft's proposals and the target's draws.

With `coupling: "gumbel"` a sampled request's token at stream position t is

    token_t = argmax_v ( log p_t(v) + G_t(v) ),   G_t(v) = -log(-log U(seed, t, v))

where p_t is the processed target distribution (temperature, penalties, top-k/top-p/min-p) and
U a counter-based uniform keyed by (seed, t, target token id). By the Gumbel-max trick token_t is
an exact sample from p_t. The draft proposes the same way over its own processed distribution q_t,
with the same noise (keyed by target ids, so a draft with its own vocabulary maps its ids through
d2t first), and the verifier accepts a draft token iff it equals token_t: the greedy acceptance
rule (`rejection.rejection_sample` with the row marked greedy) over Gumbel-max target draws.

The output then depends only on (seed, prompt, sampling params): not on k, on the draft model,
on a late or dead drafter (k=0 emits token_t too), or on the batch. The price is acceptance:
P(accept) = P(argmax(log q + G) == argmax(log p + G)), which is at most (1 - TV) / (1 + TV) of
rejection sampling's 1 - TV (Daliri, Musco, Suresh, "Coupling without Communication and
Drafter-Invariant Speculative Decoding", 2024).
"""

import torch

from gpu_worker.sampling.sampler import _shr, check, check_shape, splitmix64

STREAM_GUMBEL = 4  # after sampling.py's STREAM_DRAFT .. STREAM_RESIDUAL (0..3)
COUPLINGS = ("rejection", "gumbel")


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise G(seed, position, token id), float64, [B, T, N].

    seeds: [B] int64; positions: [B, T] int64 absolute stream positions; token_ids: [N] int64
    target-vocabulary ids (arange(V) for the target; d2t for a draft with its own vocabulary).
    u = (top 53 bits of splitmix64(key(seed, position) ^ id) + 0.5) / 2**53 lies strictly in
    (0, 1), so -log(-log u) is finite.
    """
    check(seeds.dim() == 1 and seeds.dtype == torch.int64, "seeds", "expected int64 [B]")
    check_shape(positions, (seeds.shape[0], positions.shape[-1]), "positions")
    check(token_ids.dim() == 1 and token_ids.dtype == torch.int64, "token_ids", "expected int64 [N]")
    key = splitmix64(splitmix64(splitmix64(seeds) ^ STREAM_GUMBEL)[:, None] ^ positions)  # (B, T)
    bits = splitmix64(key[..., None] ^ token_ids.to(key.device))                         # (B, T, N)
    uniforms = (_shr(bits, 11).double() + 0.5) * (2.0**-53)
    return -(-uniforms.log()).log()


def gumbel_argmax(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """argmax_v(log probs[v] + G(seed, position, token_ids[v])): an exact draw from probs.

    probs: [B, T, N] >= 0 (a row need not sum to 1; ids with 0 are never drawn); seeds [B];
    positions [B, T]; token_ids [N] the target ids of probs' columns (None: arange(N)).
    Returns [B, T] int64 column indices into probs; -1 where a row has no mass.
    """
    B, T, N = probs.shape
    token_ids = torch.arange(N, device=probs.device) if token_ids is None else token_ids
    scores = probs.double().log() + gumbel_noise(seeds, positions, token_ids)  # log 0 = -inf
    best = scores.argmax(-1)
    return torch.where(torch.isfinite(scores.amax(-1)), best, -1)
