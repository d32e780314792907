"""Per-row sampling: logit_bias and penalties, temperature, top-k, top-p, min-p, and
counter-based uniforms.

Pipeline, per row and position, in this order. Steps 0a-0b (`penalise`) depend on the tokens
before the position and come first, in vLLM v1's order (vllm/v1/sample/sampler.py `Sampler`:
allowed-token and bad-words masks, then the logits processors that can change the argmax,
min_tokens and logit_bias, then the penalties, repetition, frequency, presence, and only then
temperature, min-p and top-k/top-p). The rest (`process_logits` / `sample`) follows the order
of transformers' logits warpers: temperature, top-k, top-p, min-p (vLLM v1 applies min-p
before top-k/top-p):

0a. logit_bias: logits[j] += bias[j].
0b. penalties, over the history before the position: the prompt and the output so far (for a
   verified position: the committed output, then this step's drafts before it, the history the
   target's distribution there is conditioned on). With c[j] the count of j in the output and
   seen[j] = j in the prompt or the output: repetition (vLLM's extra; 1 = off) divides a
   positive logit of a seen token by it and multiplies a negative one; then, as OpenAI defines
   them, logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty. A row whose
   penalties are all off comes out bit for bit as it went in. Greedy rows take the argmax of
   these penalised logits. Counting the drafts is what vLLM v1's rejection sampler does too
   (vllm/v1/sample/rejection_sampler.py `_combine_outputs_with_spec_tokens`). The drafter
   applies the same steps to its own proposal, for acceptance only (drafter_core.py).
1. temperature: scaled = logits / temperature. Greedy rows (temperature 0) skip 2-5: their
   distribution is the one-hot of argmax(logits), lowest id on ties, and K = {argmax}.
2. one stable descending sort of the scaled logits; rank r = position in that order, so tied
   logits are ordered by lower token id first. Everything below is decided on this order, with
   p the softmax of the scaled logits (in vocabulary order). Only the ranks K can reach are
   sorted (`select_candidates`: the same K as a sort of all V).
3. top-k (0 = off): keep ranks r < top_k. A tie at the boundary keeps the lower ids only.
4. top-p (1 = off): renormalise over the top-k survivors, keep rank r while the mass of the
   ranks before it is < top_p (the smallest prefix reaching top_p; rank 0 is always kept). The
   masses are float64 running sums rounded to float32: before rank r, in rank order; the top-k
   survivors' in rank order; without top-k the whole vocabulary's, in vocabulary order (torch's
   CPU cumsum of float32 keeps a float64 accumulator and rounds each sum: the same bits as a
   float64 cumsum rounded, at a third of its cost; tests/gpu_worker/sampling/test_sampler.py
   holds torch to it. A GPU's cumsum accumulates in float32.)
5. min-p (0 = off): keep tokens with prob >= min_p * max prob (a ratio, so it does not matter
   whether it is taken before or after renormalising).
   K = the kept prefix of the sorted order: `candidate_ids[..., :num_candidates]`.
6. processed probs = softmax(scaled logits over K), 0 outside K: renormalised exactly once.
7. the token is drawn from the processed probs by inverse CDF in vocabulary order with one
   float64 uniform per (row, position), so the draw depends on that uniform and that row only.

Outputs: `probs` are processed (what the token is drawn from, and the `target_probs` of the
rejection sampler); raw logprobs are the logprob module's business (log_softmax of the model's
logits, before step 0).

Uniforms are counter-based: u = hash(seed, stream, absolute position), splitmix64 built from
torch int64 ops, so a request's draws do not depend on its batch, its row, or how its positions
are split into steps. Draft sampling, target sampling, the acceptance test and residual
sampling each use their own stream id.
"""

from dataclasses import dataclass

import torch

from schemas.errors import ErrorCode, SpecbusError

STREAM_DRAFT = 0
STREAM_TARGET = 1
STREAM_ACCEPT = 2
STREAM_RESIDUAL = 3


def row_seed(sampling) -> int:
    """The seed of a row's RowSampling; 0 for a greedy row, which draws nothing. GenerateRequest
    fills it for a sampled request that gave none (schemas/generation.py), so a sampled row
    without one is refused, naming the field."""
    if sampling.greedy:
        return 0
    check(sampling.seed is not None, "seed", "a sampled row needs a seed")
    return sampling.seed


class SamplingInputError(SpecbusError, ValueError):
    """Bad tensor handed to the sampling / rejection / logprob kernels: a typed `invalid_field`
    error whose field is the argument's name (e.g. "top_p", "logits"), so a caller can fail the
    one row it came from instead of its whole batch."""

    def __init__(self, name: str, message: str):
        super().__init__(ErrorCode.invalid_field, message, name)


def check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise SamplingInputError(name, message)


def check_shape(x: torch.Tensor, shape: tuple, name: str) -> None:
    check(tuple(x.shape) == tuple(shape), name, f"expected shape {tuple(shape)}, got {tuple(x.shape)}")


def check_finite_logits(logits: torch.Tensor) -> None:
    """Every row of logits (..., V) has a finite maximum: no NaN, no +inf, not all -inf (one
    pass, since amax propagates NaN). SamplingInputError naming "logits" otherwise."""
    check(bool(torch.isfinite(logits.amax(-1)).all()), "logits", "a row has NaN, +inf or no finite value")


def _int64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on signed ints)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser (Steele, Lea, Flood 2014) on int64 tensors, wrapping arithmetic.

    A bijection on 64-bit words: distinct inputs give distinct outputs.
    """
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def make_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1), float64, one per (row, position): [B, T].

    seeds: [B] int64, the request seeds. positions: [B, T] int64, absolute token positions.
    u = top 53 bits of splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ position) / 2**53.
    Each splitmix64 is a bijection, so for one seed distinct (stream, position) never share bits.
    """
    check(seeds.dim() == 1 and seeds.dtype == torch.int64, "seeds", "expected int64 [B]")
    check_shape(positions, (seeds.shape[0], positions.shape[-1]), "positions")
    check(positions.dtype == torch.int64, "positions", "expected int64")
    key = splitmix64(splitmix64(seeds) ^ stream)  # (B,)
    bits = splitmix64(key[:, None] ^ positions)  # (B, T)
    return _shr(bits, 11).double() * (2.0**-53)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters. temperature [B] (0 = greedy), top_k [B] (0 = off),
    top_p [B] in (0, 1] (1 = off), min_p [B] in [0, 1] (0 = off)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    def __post_init__(self):
        (B,) = self.temperature.shape
        for name in ("temperature", "top_k", "top_p", "min_p"):
            check_shape(getattr(self, name), (B,), name)
        check(self.top_k.dtype == torch.int64, "top_k", "expected int64")
        t = self.temperature
        check(bool(((t >= 0) & torch.isfinite(t)).all()), "temperature", "must be finite and >= 0")
        check(bool((self.top_k >= 0).all()), "top_k", "must be >= 0")
        check(bool(((self.top_p > 0) & (self.top_p <= 1)).all()), "top_p", "must be in (0, 1]")
        check(bool(((self.min_p >= 0) & (self.min_p <= 1)).all()), "min_p", "must be in [0, 1]")

    @classmethod
    def build(cls, temperature, top_k=None, top_p=None, min_p=None, device=None):
        """From Python lists (None = off for every row)."""
        B = len(temperature)
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k if top_k is not None else [0] * B, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p if top_p is not None else [1.0] * B, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p if min_p is not None else [0.0] * B, dtype=torch.float32, device=device),
        )

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    def index(self, rows: torch.Tensor) -> "SamplingTensors":
        """The parameters of the given rows (e.g. one entry per emitted token)."""
        return SamplingTensors(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows])

    @classmethod
    def cat(cls, parts: list["SamplingTensors"]) -> "SamplingTensors":
        """Rows' tensors joined into a batch's, rows in order."""
        return cls(*(torch.cat([getattr(p, name) for p in parts]) for name in cls.__dataclass_fields__))


@dataclass(frozen=True)
class Penalties:
    """Steps 0a-0b of B rows, dense for one step: the per-request state they come from is the
    request's token history, so these tensors live no longer than the logits they change.

    bias [B, V] float32 (0 = none); output_counts [B, V] float32: occurrences of each id in the
    output before the first position processed; seen [B, V] bool: ids in the prompt or that
    output; repetition [B] > 0 (1 = off); frequency [B], presence [B] (0 = off). Checks name
    the RowSampling field a bad value came from.
    """

    bias: torch.Tensor
    output_counts: torch.Tensor
    seen: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor

    def __post_init__(self):
        check(self.bias.dim() == 2, "logit_bias", f"expected [B, V], got {tuple(self.bias.shape)}")
        B, V = self.bias.shape
        check_shape(self.output_counts, (B, V), "output_counts")
        check_shape(self.seen, (B, V), "seen")
        check(self.seen.dtype == torch.bool, "seen", "expected bool")
        for name in ("repetition", "frequency", "presence"):
            check_shape(getattr(self, name), (B,), name)
        check(bool(torch.isfinite(self.bias).all()), "logit_bias", "must be finite")
        r = self.repetition
        check(bool(((r > 0) & torch.isfinite(r)).all()), "repetition_penalty", "must be finite and > 0")
        check(bool(torch.isfinite(self.frequency).all()), "frequency_penalty", "must be finite")
        check(bool(torch.isfinite(self.presence).all()), "presence_penalty", "must be finite")

    @classmethod
    def build(cls, vocab_size: int, history: torch.Tensor, prompt_len: int, *, bias_ids=None, bias_values=None,
              repetition: float = 1.0, frequency: float = 0.0, presence: float = 0.0, device=None) -> "Penalties":
        """One row. history [L] int64 ids < vocab_size: the prompt then the output (from position
        prompt_len on); bias_ids [n] int64 unique ids < vocab_size, bias_values [n]."""
        history = history.to(device=device, dtype=torch.int64)
        check(history.dim() == 1, "history", f"expected [L], got {tuple(history.shape)}")
        check(not history.numel() or 0 <= int(history.min()) and int(history.max()) < vocab_size, "history",
              f"ids out of range [0, {vocab_size})")
        counts = torch.bincount(history[prompt_len:], minlength=vocab_size).float()
        seen = torch.bincount(history, minlength=vocab_size) > 0
        bias = torch.zeros(vocab_size, device=device)
        if bias_ids is not None and len(bias_ids):
            ids = torch.as_tensor(bias_ids, dtype=torch.int64, device=device)
            check(0 <= int(ids.min()) and int(ids.max()) < vocab_size, "logit_bias",
                  f"ids out of range [0, {vocab_size})")
            bias.index_put_((ids,), torch.as_tensor(bias_values, dtype=torch.float32, device=device), accumulate=True)
        scalars = [torch.tensor([float(x)], dtype=torch.float32, device=device)
                   for x in (repetition, frequency, presence)]
        return cls(bias[None], counts[None], seen[None], *scalars)

    @classmethod
    def cat(cls, parts: list["Penalties"]) -> "Penalties":
        return cls(*(torch.cat([getattr(p, name) for p in parts]) for name in cls.__dataclass_fields__))


def add_tokens(penalties: Penalties, token_ids: torch.Tensor) -> Penalties:
    """The penalties once token_ids [B] (-1 = none for that row) joined each row's output."""
    B, V = penalties.bias.shape
    check_shape(token_ids, (B,), "token_ids")
    valid = token_ids >= 0
    counts = penalties.output_counts.clone()
    counts.scatter_add_(1, token_ids.clamp_min(0)[:, None], valid[:, None].float())
    return Penalties(penalties.bias, counts, penalties.seen | (counts > 0), penalties.repetition,
                     penalties.frequency, penalties.presence)


def penalise(logits: torch.Tensor, penalties: Penalties, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 0a-0b: logits [B, T, V] -> float32 [B, T, V].

    Position t of a row sees the output of `penalties` followed by draft_ids[:, :t] (draft_ids
    [B, T-1] int64, -1 = no token, e.g. padding past a row's drafts): verified position t is
    the target's distribution given drafts 0..t-1 accepted, so it counts them.
    """
    check(logits.dim() == 3, "logits", f"expected [B, T, V], got {tuple(logits.shape)}")
    B, T, V = logits.shape
    check_shape(penalties.bias, (B, V), "penalties")
    counts = penalties.output_counts[:, None]  # (B, 1, V)
    seen = penalties.seen[:, None]
    if draft_ids is not None and T > 1:
        check_shape(draft_ids, (B, T - 1), "draft_ids")
        drafted = torch.zeros(B, T, V, device=logits.device)
        drafted[:, 1:].scatter_(-1, draft_ids.clamp_min(0)[..., None], (draft_ids >= 0)[..., None].float())
        drafted = drafted.cumsum(1)  # (B, T, V): drafts before each position
        counts, seen = counts + drafted, seen | (drafted > 0)
    out = logits.float() + penalties.bias[:, None]
    if bool((penalties.repetition != 1).any()):
        repetition = torch.where(seen, penalties.repetition.view(B, 1, 1), 1.0)
        out = torch.where(out > 0, out / repetition, out * repetition)
    if bool((penalties.frequency != 0).any()):
        out = out - penalties.frequency.view(B, 1, 1) * counts
    if bool((penalties.presence != 0).any()):
        out = out - penalties.presence.view(B, 1, 1) * (counts > 0)
    return out


@dataclass
class ProcessedLogits:
    """probs [B, T, V] float32: processed distribution (one-hot of argmax for greedy rows).
    candidate_ids [B, T, C] int64: token ids in descending processed order (stable: lower id first
    on ties); K is the prefix of length num_candidates. C == V when the batch was sorted, else 1.
    num_candidates [B, T] int64: |K|; V means K is the whole vocabulary (no filter on that row)."""

    probs: torch.Tensor
    candidate_ids: torch.Tensor
    num_candidates: torch.Tensor


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, ..., V] / temperature [B]; greedy rows (0) are left at temperature 1."""
    temperature = torch.where(temperature == 0, 1.0, temperature).to(torch.float32)
    if bool((temperature == 1).all()):
        return logits.float()
    return logits.float() / temperature.view(-1, *([1] * (logits.dim() - 1)))


# Ranks a partial sort orders first (`ranked`); a row whose K may reach past them is ranked again
# in WIDE_WINDOW, and sorted whole only past that: a chat nucleus rarely passes the first window
# and almost never the second, and a whole vocabulary's sort costs several windows
# (ops/bench/RESULTS.md, "Wide nuclei ranked in a second window").
RANK_WINDOW = 256
WIDE_WINDOW = 4096


def ranked(scaled: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest scaled logits of each row [B, T, V], descending, tied ones by lower id
    first (step 2's order): (logits, ids) [B, T, width]. Which of the ones tied with the last
    kept value come in is not defined (`select_candidates` does not rely on them)."""
    if width >= scaled.shape[-1]:
        return scaled.sort(dim=-1, descending=True, stable=True)
    top = scaled.topk(width, dim=-1, sorted=False)
    ids, order = top.indices.sort(dim=-1)
    logits, order = top.values.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return logits, ids.gather(-1, order)


def select_candidates(scaled: torch.Tensor, params: SamplingTensors, window: int = RANK_WINDOW,
                      wide_window: int = WIDE_WINDOW):
    """Steps 2-5 of the pipeline on scaled logits [B, T, V].

    Returns candidate_ids [B, T, C] (each row's first num_candidates are K in rank order; what
    follows is not read), num_candidates [B, T] and in_k [B, T, V] bool, or None for in_k when no
    row filters (then K is everything for sampled rows and C == 1).

    Every quantity is one a row computes alone and whatever its rank cut: the probs are its
    softmax in vocabulary order, the mass before a rank their float64 running sum in rank order,
    the mass top-p renormalises over the top-k survivors' sum (without top-k: the running sum over
    the vocabulary). So ranking only the `window` largest logits (`ranked`) gives the same K as
    ranking all V wherever K ends inside the window, before its last value (no logit left out
    ties one in K); the other rows are ranked again in the `wide_window` largest, the same way,
    and the rows whose K may pass that too are ranked whole.
    """
    B, T, V = scaled.shape
    greedy = params.greedy
    filters = ~greedy & (((params.top_k > 0) & (params.top_k < V)) | (params.top_p < 1) | (params.min_p > 0))
    if not bool(filters.any()):
        argmax = scaled.argmax(-1)  # (B, T); first (lowest) id among maxima
        num_candidates = torch.where(greedy, 1, V).view(B, 1).expand(B, T).contiguous()
        return argmax[..., None], num_candidates, None

    def per_row(x: torch.Tensor) -> torch.Tensor:  # (B,) -> (B * T,)
        return x.view(B, 1).expand(B, T).reshape(-1)

    rows = scaled.reshape(B * T, V)
    probs = rows.softmax(-1)
    top_k = per_row(torch.where((params.top_k > 0) & (params.top_k < V), params.top_k, V))
    cut = RankCut(probs, top_k, per_row(params.top_p), per_row(params.min_p), per_row(greedy), per_row(filters),
                  torch.where(top_k < V, 0.0, probs.cumsum(-1)[:, -1]))
    ids, num_candidates, exact = cut.take(rows, torch.arange(B * T, device=rows.device), min(window, V))
    wide = ~exact & (per_row(filters) | per_row(greedy))

    def first(ids: torch.Tensor, num: torch.Tensor) -> torch.Tensor:  # (n, V) bool: ids' first num
        ranks = torch.arange(ids.shape[-1], device=ids.device)
        return torch.zeros(ids.shape[0], V, dtype=torch.bool, device=ids.device).scatter_(-1, ids, ranks < num[:, None])

    in_k = torch.empty_like(rows, dtype=torch.bool)
    in_k[~wide] = first(ids[~wide], num_candidates[~wide])
    # the rows left ranked wider, then whole; the others keep their ids, 0 after them (not read)
    for width in (min(wide_window, V), V):
        if not bool(wide.any()) or width <= ids.shape[-1]:
            continue
        at = wide.nonzero()[:, 0]
        wide_ids, wide_num, exact = cut.take(rows[at], at, width)
        at, wide_ids, wide_num = at[exact], wide_ids[exact], wide_num[exact]
        num_candidates[at] = wide_num
        in_k[at] = first(wide_ids, wide_num)
        ids = torch.cat([ids, ids.new_zeros(B * T, width - ids.shape[-1])], -1)
        ids[at] = wide_ids
        wide[at] = False
    in_k |= (per_row(~filters & ~greedy))[:, None]
    return ids.view(B, T, -1), num_candidates.view(B, T), in_k.view(B, T, V)


@dataclass(frozen=True)
class RankCut:
    """Steps 3-5 over rows (N, V): probs (their softmax), top_k (N,) (V = off), top_p, min_p,
    greedy, filters (N,), and total (N,), the mass top-p renormalises over where top-k is off."""

    probs: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor
    filters: torch.Tensor
    total: torch.Tensor

    def take(self, scaled: torch.Tensor, at: torch.Tensor, width: int):
        """For rows `at` (scaled (n, V) their logits): candidate ids (n, width) in rank order,
        num_candidates (n,), and whether that K is the one of ranking all V (n,) bool."""
        V = scaled.shape[-1]
        logits, ids = ranked(scaled, width)
        ranked_probs = self.probs[at].gather(-1, ids)
        top_k = self.top_k[at, None]
        keep = torch.arange(width, device=scaled.device) < top_k
        probs_k = ranked_probs.masked_fill(~keep, 0.0)
        cum = probs_k.cumsum(-1)
        mass = torch.where(top_k < V, cum.gather(-1, top_k.clamp(max=width) - 1), self.total[at, None])
        # mass before rank r, over the renormalised top-k survivors: (cum - p) / mass < top_p
        before_ok = (cum - probs_k) < self.top_p[at, None] * mass
        keep = keep & (before_ok | (self.top_p[at] >= 1)[:, None])
        keep &= ranked_probs >= self.min_p[at, None] * ranked_probs[:, :1]
        # keep is a prefix (each test fails from some rank on); greedy rows: K = {argmax}, ranked first
        num = torch.where(self.greedy[at], 1, torch.where(self.filters[at], keep.sum(-1), V))
        last_in_k = logits.gather(-1, (num.clamp(1, width) - 1)[:, None])[:, 0]
        # K ends inside the window, before any logit the window may have left out, and the top-k
        # survivors' mass was summed whole
        exact = (num < width) & (last_in_k > logits[:, -1]) & ((top_k[:, 0] <= width) | (top_k[:, 0] >= V))
        return ids, num, exact | (width == V)


def process_logits(logits: torch.Tensor, params: SamplingTensors) -> ProcessedLogits:
    """Pipeline steps 1-6 on logits [B, T, V] (any float dtype; computed in float32)."""
    check(logits.dim() == 3, "logits", f"expected [B, T, V], got {tuple(logits.shape)}")
    B, T, V = logits.shape
    check(params.temperature.shape[0] == B, "params", f"{params.temperature.shape[0]} rows for {B} logits rows")
    check_finite_logits(logits)
    scaled = scale_logits(logits, params.temperature)
    candidate_ids, num_candidates, in_k = select_candidates(scaled, params)
    if in_k is not None:
        scaled = scaled.masked_fill(~in_k, float("-inf"))
    probs = scaled.softmax(-1)
    greedy = params.greedy
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, candidate_ids[..., :1], 1.0)
        probs = torch.where(greedy.view(B, 1, 1), one_hot, probs)
    return ProcessedLogits(probs, candidate_ids, num_candidates)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw in vocabulary order: probs [..., V] >= 0 (need not sum to 1),
    uniforms [...] float64 in [0, 1). Returns ids [...] int64; -1 where the row has no mass.

    Never returns a zero-probability id: the pick is the first id whose cumulative sum exceeds
    u * total, and the cumulative sum only rises at ids with positive mass.
    """
    cdf = probs.float().cumsum(-1)
    total = cdf[..., -1:].contiguous()
    x = (uniforms[..., None] * total.double()).to(cdf.dtype)
    ids = torch.searchsorted(cdf, x, right=True)
    # u * total may round up to total in float32: cap at the first id reaching the total
    last = torch.searchsorted(cdf, total, right=False)
    ids = torch.minimum(ids, last).squeeze(-1)
    return torch.where(total.squeeze(-1) > 0, ids, -1)


def sample(logits: torch.Tensor, params: SamplingTensors, uniforms: torch.Tensor):
    """logits [B, T, V], params for B rows, uniforms [B, T] float64 (`make_uniforms`).

    Returns (ProcessedLogits, token_ids [B, T] int64). Greedy rows return argmax and do not
    consume their uniforms.
    """
    check_shape(uniforms, logits.shape[:2], "uniforms")
    check(uniforms.dtype == torch.float64, "uniforms", "expected float64")
    processed = process_logits(logits, params)
    token_ids = sample_from_probs(processed.probs, uniforms)
    token_ids = torch.where(params.greedy.view(-1, 1), processed.candidate_ids[..., 0], token_ids)
    return processed, token_ids
