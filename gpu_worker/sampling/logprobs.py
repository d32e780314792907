"""Logprobs and sampling masks for emitted tokens (docs/PROTOCOL.md#logprobs-and-sampling-masks).

Gather first, then O(V) work only on the N emitted positions: the verifier passes
logits[rows, cols] for the positions `emitted_positions` names (row-major, so a row's accepted
tokens come out in order), and the candidate sets its own `sample` call produced
(`gather_logprobs` does both). Prompt logprobs go through the same `gather_logprobs` /
`token_logprobs`, with K computed by the sampler's own `select_candidates`.

Definitions, per emitted token x with logits l (the model's logits m after logit_bias and the
penalties, sampling.py `penalise`; l = m for a row without them), scaled logits
s = l / temperature (s = l for greedy rows), candidate set K:
- raw logprob: log_softmax(m)[x], full vocabulary, no temperature, no logit_bias or penalty
  (vLLM's raw_logprobs too are taken before any processing).
- logZ_K = log sum_{j in K} softmax(s)_j: log of the mass K holds under the
  temperature-scaled distribution (0 when K is the whole vocabulary).
- processed logprob: log of the distribution the token was sampled from, log_softmax of s over
  K at x (= log_softmax(s)[x] - logZ_K), -inf outside K; computed over the whole row with -inf
  outside K, so a row's bits do not depend on the K sizes of the rows beside it, and logZ_K as
  log_softmax(s)[j] less it at a j in K. Normalised exactly once, from the logits,
  not by renormalising already-rounded probabilities. For a speculative token this is the
  target's processed distribution at that position (the marginal the rejection sampler
  preserves), so it equals what a plain forward pass gives. Greedy rows sample from the
  point mass at argmax: K = {argmax}, processed logprob 0, logZ_K = raw logprob of argmax
  (vLLM instead reports the temperature-free log-softmax for greedy rows; we report the
  distribution actually sampled from, the same rule as for every other row).
- top-n and requested ids use the chosen mode ("raw" or "processed").
- K as sorted token ids (ascending), capped at mask_cap; the most probable ids are kept when
  truncated. A row whose K is the whole vocabulary is flagged `candidates_all` and lists none.
"""

from dataclasses import dataclass

import torch

from gpu_worker.sampling.sampler import ProcessedLogits, SamplingTensors, check, check_shape, scale_logits, select_candidates
from schemas.arrays import PAD_TOKEN_ID

LOGPROBS_MODES = ("raw", "processed")


@dataclass
class TokenLogprobs:
    """One entry per emitted token, N in all.

    raw_logprobs [N], processed_logprobs [N] float32; top_ids [N, n] int64 (-1 where fewer
    than n tokens have finite logprob) and top_logprobs [N, n] in the chosen mode;
    requested_logprobs [N, R] in the chosen mode (-inf for -1 padding) or None; logz_k [N];
    candidate_ids [N, M] int64 ascending, -1 padded, M <= mask_cap; num_candidates [N] (|K|);
    candidates_truncated [N] bool (K has more than mask_cap ids); candidates_all [N] bool.
    """

    raw_logprobs: torch.Tensor
    processed_logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    requested_logprobs: torch.Tensor | None
    logz_k: torch.Tensor
    candidate_ids: torch.Tensor
    num_candidates: torch.Tensor
    candidates_truncated: torch.Tensor
    candidates_all: torch.Tensor


def emitted_positions(token_ids: torch.Tensor):
    """token_ids [B, T] int64, -1 padded -> (rows [N], cols [N]) of the emitted tokens,
    row-major (row 0's tokens in order, then row 1's...)."""
    check(token_ids.dim() == 2, "token_ids", f"expected [B, T], got {tuple(token_ids.shape)}")
    rows, cols = (token_ids >= 0).nonzero(as_tuple=True)
    return rows, cols


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: torch.Tensor,
    candidate_ids: torch.Tensor,
    num_candidates: torch.Tensor,
    *,
    mode: str = "raw",
    top_n: int = 0,
    requested_ids: torch.Tensor | None = None,
    mask_cap: int = 256,
    raw_logits: torch.Tensor | None = None,
) -> TokenLogprobs:
    """logits [N, V] at the emitted positions (after logit_bias and penalties); token_ids [N]
    int64; temperature [N] (0 = greedy); candidate_ids [N, C] and num_candidates [N] as
    `ProcessedLogits` gives them at those positions; requested_ids [N, R] int64, -1 padded;
    raw_logits [N, V]: the model's logits before logit_bias and penalties, for the raw
    logprobs (None: they are `logits`)."""
    _check_inputs(logits, token_ids, temperature, candidate_ids, num_candidates, mode=mode, top_n=top_n,
                  requested_ids=requested_ids, mask_cap=mask_cap, raw_logits=raw_logits)
    N, V = logits.shape
    logits = logits.float()
    # (N, V); the fused kernel is the cheapest logsumexp on CPU
    raw = (logits if raw_logits is None else raw_logits.float()).log_softmax(-1)
    scaled_logits = scale_logits(logits, temperature)
    scaled = raw if scaled_logits is logits and raw_logits is None else scaled_logits.log_softmax(-1)  # (N, V)

    # K is either everything or the listed prefix of candidate_ids; only the listed part is read
    everything = num_candidates >= V
    width = max(1, min(candidate_ids.shape[1], int(num_candidates.masked_fill(everything, 0).max()) if N else 1))
    listed_ids = candidate_ids[:, :width]
    listed = (torch.arange(width, device=logits.device) < num_candidates[:, None]) & ~everything[:, None]
    # Past a row's K, candidate_ids hold padding and ranks it never reached, which may repeat an id
    # of K (a wide row's batch pads with 0): scatter True only, each unlisted slot to a spare column
    # V, so no write of a repeated id can undo another (scatter_ leaves the order of writes to one
    # index undefined).
    in_k_vocab = logits.new_zeros(N, V + 1, dtype=torch.bool).scatter_(1, listed_ids.masked_fill(~listed, V), True)
    in_k_vocab = in_k_vocab[:, :V] | everything[:, None]
    # The processed distribution: log_softmax of s over K, a reduction over all V entries of the
    # row (-inf outside K). Not a logsumexp over the listed width: that width is the batch's
    # largest K, and a reduction's grouping of terms follows its length, so a row's bits would
    # depend on the rows emitted beside it.
    processed = torch.where(everything[:, None], scaled, scaled.masked_fill(~in_k_vocab, float("-inf")).log_softmax(-1))
    first = listed_ids[:, :1]  # a member of K where K is listed
    logz_k = torch.where(everything, 0.0, (scaled.gather(1, first) - processed.gather(1, first)).squeeze(1))

    token = token_ids[:, None]
    raw_logprobs = raw.gather(1, token).squeeze(1)
    processed_logprobs = processed.gather(1, token).squeeze(1)                    # -inf outside K

    values = raw if mode == "raw" else processed
    top_ids, top_logprobs, requested_logprobs = _top_and_requested(values, top_n, requested_ids)

    shown = min(width, mask_cap)
    mask_ids = listed_ids[:, :shown].masked_fill(~listed[:, :shown], V).sort(-1).values
    return TokenLogprobs(
        raw_logprobs=raw_logprobs,
        processed_logprobs=processed_logprobs,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        requested_logprobs=requested_logprobs,
        logz_k=logz_k,
        candidate_ids=mask_ids.masked_fill(mask_ids == V, PAD_TOKEN_ID),
        num_candidates=num_candidates,
        candidates_truncated=~everything & (num_candidates > mask_cap),
        candidates_all=everything,
    )


def _check_inputs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: torch.Tensor,
                  candidate_ids: torch.Tensor, num_candidates: torch.Tensor, *, mode: str, top_n: int,
                  requested_ids: torch.Tensor | None, mask_cap: int, raw_logits: torch.Tensor | None) -> None:
    """`token_logprobs`' argument checks: shapes, id ranges and options, each error naming its
    argument."""
    check(mode in LOGPROBS_MODES, "mode", f"unknown logprobs mode {mode!r}, expected one of {LOGPROBS_MODES}")
    check(logits.dim() == 2, "logits", f"expected [N, V], got {tuple(logits.shape)}")
    N, V = logits.shape
    check_shape(token_ids, (N,), "token_ids")
    check_shape(temperature, (N,), "temperature")
    check_shape(num_candidates, (N,), "num_candidates")
    check(candidate_ids.dim() == 2 and candidate_ids.shape[0] == N, "candidate_ids",
          f"expected [{N}, C], got {tuple(candidate_ids.shape)}")
    check(bool(((token_ids >= 0) & (token_ids < V)).all()), "token_ids", f"ids out of range [0, {V})")
    check(0 <= top_n <= V, "top_n", f"must be in 0..{V}")
    check(mask_cap >= 1, "mask_cap", "must be >= 1")
    if requested_ids is not None:
        check(requested_ids.dim() == 2 and requested_ids.shape[0] == N, "requested_ids",
              f"expected [{N}, R], got {tuple(requested_ids.shape)}")
        check(bool(((requested_ids >= PAD_TOKEN_ID) & (requested_ids < V)).all()), "requested_ids",
              f"ids out of range [0, {V}) ({PAD_TOKEN_ID} pads)")
    if raw_logits is not None:
        check_shape(raw_logits, (N, V), "raw_logits")


def _top_and_requested(values: torch.Tensor, top_n: int, requested_ids: torch.Tensor | None):
    """From values (N, V), logprobs in the chosen mode: top_ids (N, top_n) (-1 where the value
    is -inf), top_logprobs (N, top_n) and the logprobs of requested_ids (N, R) (-inf at -1
    padding; None without requested_ids)."""
    top_logprobs, top_ids = values.topk(top_n, dim=-1)
    top_ids = top_ids.masked_fill(top_logprobs == float("-inf"), PAD_TOKEN_ID)
    requested_logprobs = None
    if requested_ids is not None:
        requested_logprobs = values.gather(1, requested_ids.clamp_min(0))
        requested_logprobs = requested_logprobs.masked_fill(requested_ids < 0, float("-inf"))
    return top_ids, top_logprobs, requested_logprobs


def gather_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    params: SamplingTensors,
    processed: ProcessedLogits | None = None,
    raw_logits: torch.Tensor | None = None,
    **options,
):
    """Logprobs at the positions where token_ids [B, T] is not -1, gathered before any O(V) work.

    logits [B, T, V]: logits[b, t] is the distribution token_ids[b, t] was drawn from (for a
    verify step: the K+1 verify positions, after logit_bias and penalties, and
    `RejectionResult.token_ids`; for a prompt: the prompt positions and the next prompt ids).
    params for the B rows. processed: the `sample` output for these logits, whose K is reused;
    None (prompt logprobs, greedy batches) computes K on the gathered positions with the
    sampler's own `select_candidates`. raw_logits [B, T, V]: the model's logits where they
    differ from `logits` (penalised rows), for the raw logprobs. options are `token_logprobs`'
    keyword arguments. Returns (rows [N], cols [N], TokenLogprobs).
    """
    check(logits.dim() == 3, "logits", f"expected [B, T, V], got {tuple(logits.shape)}")
    check_shape(token_ids, logits.shape[:2], "token_ids")
    rows, cols = emitted_positions(token_ids)
    gathered = logits[rows, cols]  # (N, V)
    row_params = params.index(rows)
    if processed is None:
        scaled = scale_logits(gathered, row_params.temperature)[:, None]  # (N, 1, V)
        candidate_ids, num_candidates, _ = select_candidates(scaled, row_params)
        candidate_ids, num_candidates = candidate_ids[:, 0], num_candidates[:, 0]
    else:
        candidate_ids, num_candidates = processed.candidate_ids[rows, cols], processed.num_candidates[rows, cols]
    if raw_logits is not None:
        check_shape(raw_logits, logits.shape, "raw_logits")
        options["raw_logits"] = raw_logits[rows, cols]
    result = token_logprobs(
        gathered, token_ids[rows, cols], row_params.temperature, candidate_ids, num_candidates, **options
    )
    return rows, cols, result
