"""A verifier's measured pace, and the two rules that follow from it: how many tokens a step
gives that verifier (the step budget) and how long the scheduler waits for its answer (the
verify deadline) (docs/PROTOCOL.md#step-budget). No NATS, no clocks: the scheduler's core
tells `StepBudget.timed` each answered verify batch (verify_timed).

A batch's time at the verifier, as the scheduler times it (its round trip, the bus included,
less the time it waited behind this scheduler's batch answered before it: a verifier runs one
batch at a time, and the scheduler's lanes send it theirs at once), is modelled per verifier as

    seconds(T) = overhead + per_token * T        T: the batch's new tokens, drafts included

fitted by least squares over the answered batches, each older batch weighing PACE_DECAY less
than the next (an exponentially weighted fit, so the pace follows the verifier's load). When
the sizes timed are too alike to tell the two terms apart (a run of decode-only steps between
prompts), or the fit says a token costs nothing, per_token is the one of the last fit that told
them apart and overhead what the recent batches' times leave of theirs (so the pace still follows
the load, and a step of decode rows is not taken for a step of as many prompt tokens); with no
such fit yet, overhead is 0 and per_token the weighted mean seconds per token: a cautious pace
(it charges every token its share of the overhead, so it never overstates the tokens that fit).

- Step budget: the tokens that fit in target_step_s, (target_step_s - overhead) / per_token,
  within [MIN_STEP_TOKENS, max_step_tokens]; COLD_STEP_TOKENS for a verifier never timed (its
  first batches are small, and are its first timings). The step planner gives decode rows
  their tokens first and prefill chunks the rest of the budget, but at least as many tokens as
  the decode rows and at least MIN_STEP_TOKENS while prompts wait, so every step makes
  progress (step_planner.py).
- Step rows: the rows a verifier's step may hold, so that a step stays near target_step_s
  however many requests run (the decode rows come first in every step, so their number, not the
  budget, sets a loaded step's time: the inter-token latency of every running request). Decode
  rows may fill DECODE_SHARE of target_step_s: while prompts wait, prefill takes at least as
  many tokens as the decode rows (step_planner.py), so a step with both stays near the target.
  Each lane step (its draft, verify and commit, as the scheduler times it) gives an estimate,
  its decode rows * DECODE_SHARE * target_step_s / the part of its time that was theirs (the
  step less its prefill tokens at the verifier's per-token pace, at least MIN_DECODE_SHARE of
  it), averaged with PACE_DECAY like the pace. With a decode step time of overhead + cost *
  rows the estimate's fixed point is the rows that fit, (DECODE_SHARE * target_step_s -
  overhead) / cost, and it approaches it from either side. A queued request starts on a
  verifier only while fewer requests run there than lanes * that (one always may: progress);
  the others wait queued, their time counting against their deadline (Sarathi-Serve's rule:
  the step time is the latency budget, arXiv:2403.02310).
- Verify deadline: a batch of T tokens may take max(verify_timeout_s, VERIFY_SLACK * lanes *
  seconds(max(T, step budget))) per try, as if every lane's batch were as large and queued
  before it (verify_timeout_s for a verifier never timed), and VerifyRequest.deadline is that
  times (verify_retries + 1), so the same message may be sent again. The scheduler's shell
  waits on past a try's time while the verifier heartbeats (services/scheduler/scheduler.py
  `Scheduler.verify`).
"""

from collections import deque
from dataclasses import dataclass

PACE_DECAY = 0.9  # the weight of a timing relative to the next one
MIN_SPREAD = 0.25  # the sizes' standard deviation, relative to their mean, that the fit needs
COLD_STEP_TOKENS = 64  # the step budget of a verifier never timed
MIN_STEP_TOKENS = 32  # the least step budget, and the least prefill a step takes while prompts wait
VERIFY_SLACK = 4.0  # a try's wait, in predicted round trips of its batch
DECODE_SHARE = 0.5  # the share of target_step_s a step's decode rows may fill (step rows)
MIN_DECODE_SHARE = 0.25  # the least share of a step's time its decode rows are taken to cost
ANSWERS_KEPT = 8  # answer times kept per verifier, to tell a batch's wait behind another from its own time


@dataclass
class Pace:
    """Exponentially weighted sums over (T, seconds) of one verifier's answered batches."""

    weight: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    tokens_sq: float = 0.0
    tokens_seconds: float = 0.0
    per_token: float | None = None  # the cost of a token when the sizes last told the terms apart

    def add(self, tokens: int, seconds: float) -> None:
        d = PACE_DECAY
        self.weight = d * self.weight + 1.0
        self.tokens = d * self.tokens + tokens
        self.seconds = d * self.seconds + seconds
        self.tokens_sq = d * self.tokens_sq + tokens * tokens
        self.tokens_seconds = d * self.tokens_seconds + tokens * seconds
        separated = self.separate()
        if separated is not None:
            self.per_token = separated[1]

    def means(self) -> tuple[float, float]:
        return self.tokens / self.weight, self.seconds / self.weight

    def separate(self) -> tuple[float, float] | None:
        """(overhead, per_token) by least squares, None when the sizes are too alike (or the fit
        says a token costs nothing or the overhead is negative)."""
        mean_t, mean_s = self.means()
        var_t = self.tokens_sq / self.weight - mean_t * mean_t
        cov = self.tokens_seconds / self.weight - mean_t * mean_s
        if var_t > (MIN_SPREAD * mean_t) ** 2 and cov > 0.0:
            per_token = cov / var_t
            overhead = mean_s - per_token * mean_t
            if overhead >= 0.0:
                return overhead, per_token
        return None

    def fit(self) -> tuple[float, float] | None:
        """(overhead, per_token) seconds (module docstring); None before any timing."""
        if self.weight == 0.0 or self.tokens <= 0.0:
            return None
        separated = self.separate()
        if separated is not None:
            return separated
        mean_t, mean_s = self.means()
        if self.per_token is not None and mean_s > self.per_token * mean_t:
            return mean_s - self.per_token * mean_t, self.per_token
        return 0.0, max(mean_s, 0.0) / mean_t

    def predict(self, tokens: int) -> float | None:
        """seconds(tokens), None before any timing."""
        fitted = self.fit()
        return None if fitted is None else fitted[0] + fitted[1] * tokens


class StepBudget:
    """The pace of every verifier timed, and the step budget and verify deadline it gives."""

    def __init__(self, target_step_s: float, max_step_tokens: int, verify_timeout_s: float, lanes: int = 1):
        self.target_step_s = target_step_s
        self.max_step_tokens = max_step_tokens
        self.verify_timeout_s = verify_timeout_s
        self.lanes = lanes
        self.paces: dict[str, Pace] = {}
        self.answered: dict[str, deque] = {}  # verifier_id -> when its last batches were answered
        self.rows_fit: dict[str, float] = {}  # verifier_id -> the rows a lane's step fits in target_step_s

    def timed(self, verifier_id: str, tokens: int, seconds: float, answered_at: float | None = None) -> None:
        """An answered verify batch of `tokens` new tokens took `seconds` there and back, answered
        at monotonic time answered_at (None: nothing else was in flight there)."""
        started = None if answered_at is None else answered_at - seconds
        if answered_at is not None:
            answers = self.answered.setdefault(verifier_id, deque(maxlen=ANSWERS_KEPT))
            before = max((at for at in answers if started < at < answered_at), default=started)
            seconds = answered_at - before  # its own time: from the answer it queued behind
            answers.append(answered_at)
        if tokens > 0:
            self.paces.setdefault(verifier_id, Pace()).add(tokens, seconds)

    def step_tokens(self, verifier_id: str) -> int:
        """The tokens a step gives verifier_id (module docstring)."""
        pace = self.paces.get(verifier_id)
        fitted = None if pace is None else pace.fit()
        if fitted is None:
            return min(COLD_STEP_TOKENS, self.max_step_tokens)
        overhead, per_token = fitted
        fit = (self.target_step_s - overhead) / per_token if per_token > 0.0 else float(self.max_step_tokens)
        return round(min(max(fit, MIN_STEP_TOKENS), self.max_step_tokens))

    def attempt_s(self, verifier_id: str, tokens: int) -> float:
        """How long one try of a batch of `tokens` tokens to verifier_id is waited for."""
        pace = self.paces.get(verifier_id)
        predicted = None if pace is None else pace.predict(max(tokens, self.step_tokens(verifier_id)))
        return self.verify_timeout_s if predicted is None else \
            max(self.verify_timeout_s, VERIFY_SLACK * self.lanes * predicted)

    def step_timed(self, verifier_id: str, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """A lane step whose verify batch to verifier_id held decode_rows decode rows and computed
        prefill_tokens prompt tokens took seconds from its drafts to its commits (module docstring)."""
        if decode_rows < 1 or seconds <= 0.0:
            return
        pace = self.paces.get(verifier_id)
        fitted = None if pace is None else pace.fit()
        prefill_s = 0.0 if fitted is None else fitted[1] * prefill_tokens
        fit = decode_rows * DECODE_SHARE * self.target_step_s / max(seconds - prefill_s, MIN_DECODE_SHARE * seconds)
        known = self.rows_fit.get(verifier_id)
        self.rows_fit[verifier_id] = fit if known is None else PACE_DECAY * known + (1.0 - PACE_DECAY) * fit

    def room(self, verifier_id: str, running: int) -> bool:
        """Whether one more request may start on verifier_id beside the `running` ones there."""
        fit = self.rows_fit.get(verifier_id)
        return running == 0 or fit is None or running < self.lanes * fit
