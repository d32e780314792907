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

from gpu_worker.runtime.kernel_paths import candidates_kernel
from gpu_worker.sampling.sampler import (
    ProcessedLogits,
    SamplingTensors,
    _shr,
    check,
    check_finite_logits,
    check_shape,
    sample,
    scale_logits,
    splitmix64,
)

STREAM_GUMBEL = 4  # after sampling.py's STREAM_DRAFT .. STREAM_RESIDUAL (0..3)
COUPLINGS = ("rejection", "gumbel")


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise G(seed, position, token id), float64, [B, T, N].

    seeds: [B] int64; positions: [B, T] int64 absolute stream positions; token_ids: [N] int64
    target-vocabulary ids (arange(V) for the target; d2t for a draft with its own vocabulary).
    u = (top 53 bits of splitmix64(key(seed, position) ^ id) + 0.5) / 2**53 lies strictly in
    (0, 1), so -log(-log u) is finite.
    """
    check(token_ids.dim() == 1 and token_ids.dtype == torch.int64, "token_ids", "expected int64 [N]")
    return _noise(_uniforms(stream_keys(seeds, positions)[..., None], token_ids.to(seeds.device)))


def stream_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """key(seed, position) [B, T] int64 of seeds [B], positions [B, T]: the noise's per-draw key."""
    check(seeds.dim() == 1 and seeds.dtype == torch.int64, "seeds", "expected int64 [B]")
    check_shape(positions, (seeds.shape[0], positions.shape[-1]), "positions")
    return splitmix64(splitmix64(splitmix64(seeds) ^ STREAM_GUMBEL)[:, None] ^ positions)


def _uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """u(key, id) float64, keys and token_ids broadcast together."""
    return (_shr(splitmix64(keys ^ token_ids), 11).double() + 0.5) * (2.0**-53)


def _noise(uniforms: torch.Tensor) -> torch.Tensor:
    return -(-uniforms.log()).log()


def _scores_argmax(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (R, N) of probs and their uniforms: (the top score log p + G(u) (R,) float64, its
    index (R,), the lowest on a tie, -1 where a row has no mass)."""
    scores = probs.double().log() + _noise(uniforms)  # log 0 = -inf
    best = scores.amax(-1)
    return best, torch.where(torch.isfinite(best), scores.argmax(-1), -1)


# Tokens a row scores when the kernel picks them (a multiple of 8: torch's vectorised log then
# takes every one, as it does over a whole vocabulary row, so the scores have the same bits).
CANDIDATES = 16
BOUND_SLACK = 1e-6  # relative, on e^-best: far above the float64 rounding of the scores and keys


def gumbel_argmax(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  token_ids: torch.Tensor | None = None, candidates: int = CANDIDATES) -> torch.Tensor:
    """argmax_v(log probs[v] + G(seed, position, token_ids[v])): an exact draw from probs.

    probs: [B, T, N] >= 0 (a row need not sum to 1; ids with 0 are never drawn); seeds [B];
    positions [B, T]; token_ids [N] the target ids of probs' columns (None: arange(N)).
    Returns [B, T] int64 column indices into probs, the lowest on a tie; -1 where a row has no mass.

    Scoring all N tokens costs a hash and two logs each (most of a millisecond a row at V = 49152).
    Where the kernel serves (float32 probs on the CPU), a row scores `candidates` tokens instead,
    with the same result (the exponential race): with E = -log u, a token's score
    log p + G = -log(E / p) reaches s only if E <= p e^-s, and E >= 1 - u, so only if
    (1 - u) / p <= e^-s. The kernel returns the tokens of least (1 - u) / p; where the next one's
    exceeds e^-best (best: the top score among them) no other token can reach best, else the row
    is scored whole.
    """
    B, T, N = probs.shape
    token_ids = torch.arange(N, device=probs.device) if token_ids is None else token_ids
    check(token_ids.dim() == 1 and token_ids.dtype == torch.int64, "token_ids", "expected int64 [N]")
    keys = stream_keys(seeds, positions).reshape(B * T, 1)
    rows = probs.reshape(B * T, N)
    kernel = candidates_kernel(rows, candidates)
    if kernel is None:
        return _scores_argmax(rows, _uniforms(keys, token_ids.to(keys.device)))[1].reshape(B, T)
    race, picked = kernel.gumbel_candidates(rows.contiguous(), keys[:, 0].contiguous(), token_ids.contiguous(),
                                            candidates + 1)
    picked, order = picked[:, :candidates].sort(dim=-1)  # vocabulary order: ties go as over all N
    has_mass = torch.isfinite(race[:, :candidates].gather(-1, order))  # else a filler id, scored -inf
    best, at = _scores_argmax(torch.where(has_mass, rows.gather(-1, picked), 0.0),
                              _uniforms(keys, token_ids[picked]))
    drawn = torch.where(at >= 0, picked.gather(-1, at.clamp_min(0)[:, None])[:, 0], -1)
    after = race[:, candidates]  # the least key left out (inf: none has mass)
    certain = torch.isinf(after) | (after > torch.exp(-best) * (1 + BOUND_SLACK))
    if not bool(certain.all()):
        drawn[~certain] = _scores_argmax(rows[~certain], _uniforms(keys[~certain], token_ids))[1]
    return drawn.reshape(B, T)


def proposal_law(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """A draft's law for its Gumbel-coupled proposals: softmax(logits / temperature) of each row
    (B, ..., V) -> float32, temperature [B] (> 0), without the target's filters (top-k, top-p,
    min-p). The drafter proposes argmax(log q + G) over it (`gumbel_argmax`) and ranks a tree's
    children by log q + G: any proposal leaves the output the target's draw, and the filters would
    only keep the draft from proposing in its own tail (at most 1 - top_p of its mass, there
    rejected) at the cost of ranking its vocabulary at every position (process_logits), several
    times this law and the draw (ops/bench/RESULTS.md, "Gumbel-coupled drafts proposed from the
    tempered law"). A row without a finite maximum fails as in process_logits (`check_finite_logits`)."""
    check_finite_logits(logits)
    return scale_logits(logits, temperature).softmax(-1)


def coupled_sample(logits: torch.Tensor, params: SamplingTensors, uniforms: torch.Tensor, gumbel: torch.Tensor,
                   seeds: torch.Tensor, positions: torch.Tensor,
                   token_ids: torch.Tensor | None = None) -> tuple[ProcessedLogits, torch.Tensor]:
    """`sample`'s processed laws and draws [B, T] for logits [B, T, N], except that the rows with
    gumbel [B] bool draw by `gumbel_argmax` at (seeds [B], positions [B, T]), token_ids as there:
    how the verifier draws the target's tokens."""
    processed, ids = sample(logits, params, uniforms)
    if bool(gumbel.any()):
        ids[gumbel] = gumbel_argmax(processed.probs[gumbel], seeds[gumbel], positions[gumbel], token_ids)
    return processed, ids
