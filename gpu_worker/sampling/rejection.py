"""Speculative-decoding rejection sampler (docs/PROTOCOL.md#speculative-decoding-contract), in target-vocabulary space:
the chain kernel of gpu_worker/sampling/acceptance.py `accept` (which callers use), and the
proposals' decoding into draft laws (`proposal_to_draft_probs`).

Per row with n = num_draft draft tokens d_1..d_n, proposal distributions p_i (draft_probs),
target distributions q_1..q_{n+1} (target_probs: what the target sampler draws from) and the
target sampler's own draws t_1..t_{n+1} (target_token_ids; argmax for greedy rows):

- greedy rows: accept d_i while d_i == t_i; at the first mismatch emit t_i (the recovered
  token); if all n match emit the bonus t_{n+1}.
- sampled rows: accept d_i iff u_i * p_i(d_i) < q_i(d_i) (Leviathan et al. 2023, Chen et al.
  2023), never because d_i == t_i. At the first rejection emit the recovered token drawn from
  normalize(max(q_i - p_i, 0)); if all n are accepted emit the bonus t_{n+1} (no uniform used).
  A residual with zero mass (inconsistent inputs) emits t_i and is flagged.

Output: token_ids [B, K+1] = accepted draft tokens, then the recovered or bonus token, then -1.
Only the rejected rows pay O(V), and only at their rejection position.
"""

from dataclasses import dataclass

import torch

from gpu_worker.sampling.sampler import check, check_shape, sample_from_probs
from schemas.arrays import PAD_TOKEN_ID

PROPOSAL_KINDS = ("point_mass", "sparse", "dense")


@dataclass
class RejectionResult:
    """token_ids [B, K+1] int64 (emitted tokens, then -1); num_accepted [B] int64 (accepted
    draft tokens; the row emits num_accepted + 1 tokens); residual_fallback [B] bool (the
    recovered token was t_i because the residual had no mass)."""

    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    residual_fallback: torch.Tensor

    @property
    def num_residual_fallbacks(self) -> int:
        return int(self.residual_fallback.sum())


def check_probs(x: torch.Tensor, name: str) -> None:
    check(x.is_floating_point(), name, f"expected a float tensor, got {x.dtype}")
    # one pass: amin propagates NaN, so a NaN shows up as a non-finite minimum
    low = x.amin()
    check(not bool(torch.isnan(low)), name, "contains NaN")
    check(bool(low >= 0), name, "contains negative probabilities")


def check_ids(ids: torch.Tensor, valid: torch.Tensor, vocab_size: int, name: str) -> None:
    check(ids.dtype == torch.int64, name, f"expected int64, got {ids.dtype}")
    in_range = (ids >= 0) & (ids < vocab_size)
    check(bool((in_range | ~valid).all()), name, f"ids out of range [0, {vocab_size})")
    check(bool(((ids == PAD_TOKEN_ID) | in_range).all()), name, f"padding must be {PAD_TOKEN_ID}")


def accepted_prefix(accepted: torch.Tensor) -> torch.Tensor:
    """accepted [B, K] bool, per draft slot -> [B] int64, the length of the accepted prefix (a
    draft counts only when every draft before it was accepted)."""
    return accepted.long().cumprod(-1).sum(-1)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    target_token_ids: torch.Tensor,
    greedy: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    uniforms: torch.Tensor | None = None,
    residual_uniforms: torch.Tensor | None = None,
    check_values: bool = True,
) -> RejectionResult:
    """Accept or reject draft tokens against the target distributions.

    draft_token_ids [B, K] int64, target-vocab ids, -1 beyond num_draft.
    num_draft [B] int64 in 0..K.
    draft_probs [B, K, V] float, or None for point-mass proposals (p_i = one-hot at d_i).
    target_probs [B, K+1, V] float: processed target distributions (rows of `sample`'s probs).
    target_token_ids [B, K+1] int64: the target sampler's draws; slots past num_draft may be -1.
    greedy [B] bool.
    uniforms [B, K] float64: acceptance uniforms (stream STREAM_ACCEPT); residual_uniforms
    [B, K] float64: recovered-token uniforms, the one at the rejection slot is used (stream
    STREAM_RESIDUAL). Either, if None, is drawn from `generator` (never the global RNG:
    a fresh unseeded generator is used when both are None).
    check_values: scan draft_probs and target_probs once each for NaN / negative values.
    Contiguous draft_probs / target_probs avoid a full copy when rows are rejected.
    """
    B, K, V = _check_shapes(draft_token_ids, num_draft, target_probs, target_token_ids, greedy)
    device = target_probs.device
    slot = torch.arange(K + 1, device=device)
    valid = slot < num_draft[:, None]  # (B, K+1): draft slots in use
    check_ids(draft_token_ids, valid[:, :K], V, "draft_token_ids")
    check_ids(target_token_ids, slot <= num_draft[:, None], V, "target_token_ids")
    if draft_probs is not None:
        check_shape(draft_probs, (B, K, V), "draft_probs")
    if check_values:
        check_probs(target_probs, "target_probs")
        if draft_probs is not None:
            check_probs(draft_probs, "draft_probs")
    uniforms, residual_uniforms = draw_uniforms(B, K, device, generator, uniforms, residual_uniforms)

    draft_ids = draft_token_ids.clamp_min(0)  # -1 padding gathers id 0, masked out by `valid`
    target_at_draft = target_probs[:, :K].gather(-1, draft_ids[..., None]).squeeze(-1)  # (B, K)
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1).to(target_at_draft.dtype)
    accept_sampled = uniforms * draft_at_draft < target_at_draft
    accept_greedy = draft_token_ids == target_token_ids[:, :K]
    accepted = torch.where(greedy[:, None], accept_greedy, accept_sampled) & valid[:, :K]
    num_accepted = accepted_prefix(accepted)  # (B,)

    # bonus (all accepted), greedy recovered token, or the fallback for an empty residual
    last_token = target_token_ids.gather(1, num_accepted[:, None]).squeeze(1)  # (B,)
    residual_fallback = torch.zeros(B, dtype=torch.bool, device=device)
    rows = ((num_accepted < num_draft) & ~greedy).nonzero().squeeze(1)  # rejected sampled rows
    if rows.numel() > 0:
        recovered = _recover(rows, num_accepted[rows], draft_ids, draft_probs, target_probs, residual_uniforms)
        empty = recovered < 0
        residual_fallback[rows] = empty
        last_token[rows] = torch.where(empty, last_token[rows], recovered)

    token_ids = torch.where(slot[:K] < num_accepted[:, None], draft_token_ids, PAD_TOKEN_ID)
    token_ids = torch.cat([token_ids, torch.full((B, 1), PAD_TOKEN_ID, dtype=torch.int64, device=device)], 1)
    token_ids.scatter_(1, num_accepted[:, None], last_token[:, None])
    return RejectionResult(token_ids, num_accepted, residual_fallback)


def _check_shapes(draft_token_ids: torch.Tensor, num_draft: torch.Tensor, target_probs: torch.Tensor,
                  target_token_ids: torch.Tensor, greedy: torch.Tensor) -> tuple[int, int, int]:
    """`rejection_sample`'s shape and dtype checks of everything but draft_probs; returns (B, K, V)."""
    check(draft_token_ids.dim() == 2, "draft_token_ids", f"expected [B, K], got {tuple(draft_token_ids.shape)}")
    B, K = draft_token_ids.shape
    check(target_probs.dim() == 3, "target_probs", f"expected [B, K+1, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[-1]
    check_shape(target_probs, (B, K + 1, V), "target_probs")
    check_shape(num_draft, (B,), "num_draft")
    check_shape(target_token_ids, (B, K + 1), "target_token_ids")
    check_shape(greedy, (B,), "greedy")
    check(greedy.dtype == torch.bool, "greedy", f"expected bool, got {greedy.dtype}")
    check(num_draft.dtype == torch.int64, "num_draft", f"expected int64, got {num_draft.dtype}")
    check(bool(((num_draft >= 0) & (num_draft <= K)).all()), "num_draft", f"must be in 0..{K}")
    return B, K, V


def draw_uniforms(B: int, K: int, device, generator: torch.Generator | None, uniforms: torch.Tensor | None,
                   residual_uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance and residual uniforms (B, K) float64: those given (checked), the others
    drawn from generator (a fresh unseeded one when it is None), acceptance first."""
    if generator is None and (uniforms is None or residual_uniforms is None):
        generator = torch.Generator(device=device)
        generator.seed()
    for name, u in (("uniforms", uniforms), ("residual_uniforms", residual_uniforms)):
        if u is not None:
            check_shape(u, (B, K), name)
            check(u.dtype == torch.float64, name, f"expected float64, got {u.dtype}")
    if uniforms is None:
        uniforms = torch.rand(B, K, generator=generator, dtype=torch.float64, device=device)
    if residual_uniforms is None:
        residual_uniforms = torch.rand(B, K, generator=generator, dtype=torch.float64, device=device)
    return uniforms, residual_uniforms


def _recover(rows: torch.Tensor, at: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
             target_probs: torch.Tensor, residual_uniforms: torch.Tensor) -> torch.Tensor:
    """The recovered tokens of the rejected rows (R,) at their rejection slots at (R,): drawn
    from normalize(max(q - p, 0)) with the residual uniform there; -1 where that has no mass.
    draft_ids (B, K) with padding clamped to 0; draft_probs (B, K, V) or None (point masses);
    target_probs (B, K+1, V)."""
    K = draft_ids.shape[1]
    # index_select on the flattened positions copies whole rows (advanced indexing does not)
    residual = target_probs.flatten(0, 1).index_select(0, rows * (K + 1) + at).float()  # (R, V)
    if draft_probs is None:
        # max(q - onehot(d), 0) is q with d zeroed, since q(d) <= 1
        residual.scatter_(-1, draft_ids[rows, at][:, None], 0.0)
    else:
        residual.sub_(draft_probs.flatten(0, 1).index_select(0, rows * K + at)).clamp_min_(0.0)
    return sample_from_probs(residual, residual_uniforms[rows, at])


def map_draft_probs_to_target(draft_probs: torch.Tensor, d2t: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """draft_probs [B, K, Vd] in draft-vocab space -> [B, K, V] in target space.

    d2t [Vd] int64: draft id -> target id. Scatter-add, so draft ids mapped to one target id
    add up (the total mass of every row is kept).
    """
    check(draft_probs.dim() == 3, "draft_probs", f"expected [B, K, Vd], got {tuple(draft_probs.shape)}")
    B, K, Vd = draft_probs.shape
    check_shape(d2t, (Vd,), "d2t")
    check_ids(d2t, torch.ones_like(d2t, dtype=torch.bool), target_vocab_size, "d2t")
    out = draft_probs.new_zeros(B, K, target_vocab_size)
    return out.index_add_(-1, d2t, draft_probs)


def proposal_to_draft_probs(
    kind: str,
    draft_token_ids: torch.Tensor,
    target_vocab_size: int,
    *,
    sparse_ids: torch.Tensor | None = None,
    sparse_probs: torch.Tensor | None = None,
    dense_probs: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Decode a proposal into the draft_probs argument of `rejection_sample`.

    draft_token_ids [B, K] int64 (target ids, -1 padded).
    point_mass: returns None (one-hot at each draft token).
    sparse: sparse_ids [B, K, S] int64 (-1 padded) and sparse_probs [B, K, S] -> [B, K, V].
    dense: dense_probs [B, K, V], or [B, K, Vd] with d2t -> [B, K, V].
    d2t [Vd] int64: when given, sparse_ids / dense_probs are in draft-vocab space and are mapped
    with a scatter-add (many-to-one keeps mass). Draft token ids are always target ids.
    """
    check(kind in PROPOSAL_KINDS, "kind", f"unknown proposal kind {kind!r}, expected one of {PROPOSAL_KINDS}")
    check(draft_token_ids.dim() == 2, "draft_token_ids", f"expected [B, K], got {tuple(draft_token_ids.shape)}")
    B, K = draft_token_ids.shape
    if kind == "point_mass":
        return None
    if kind == "dense":
        check(dense_probs is not None, "dense_probs", "required for a dense proposal")
        check(dense_probs.dim() == 3 and dense_probs.shape[:2] == (B, K), "dense_probs",
              f"expected [{B}, {K}, V], got {tuple(dense_probs.shape)}")
        check_probs(dense_probs, "dense_probs")
        if d2t is not None:
            return map_draft_probs_to_target(dense_probs, d2t, target_vocab_size)
        check_shape(dense_probs, (B, K, target_vocab_size), "dense_probs")
        return dense_probs
    check(sparse_ids is not None and sparse_probs is not None, "sparse_ids", "sparse_ids and sparse_probs required")
    check(sparse_ids.dim() == 3 and sparse_ids.shape[:2] == (B, K), "sparse_ids",
          f"expected [{B}, {K}, S], got {tuple(sparse_ids.shape)}")
    check_shape(sparse_probs, sparse_ids.shape, "sparse_probs")
    check_probs(sparse_probs, "sparse_probs")
    source_vocab = target_vocab_size if d2t is None else d2t.shape[0]
    check_ids(sparse_ids, sparse_ids >= 0, source_vocab, "sparse_ids")
    check(bool((sparse_probs[sparse_ids < 0] == 0).all()), "sparse_probs", "padding slots must hold 0")
    ids = sparse_ids.clamp_min(0)
    if d2t is not None:
        check(d2t.dim() == 1, "d2t", f"expected [Vd], got {tuple(d2t.shape)}")
        check_ids(d2t, torch.ones_like(d2t, dtype=torch.bool), target_vocab_size, "d2t")
        ids = d2t[ids]
    out = sparse_probs.new_zeros(B, K, target_vocab_size)
    return out.scatter_add_(-1, ids, sparse_probs)

