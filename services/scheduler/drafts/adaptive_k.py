"""Adaptive speculation length: per request and step, the number of drafts k_t in [0, k] that
maximises its verify batch's expected tokens per second; the request's k is the upper bound.

    E(k_t) = 1 + sum_{j=1..k_t} prod_{i<=j} a_i       tokens a step emits (the accepted drafts, then
                                                       one recovered or bonus token), a_i the
                                                       acceptance at draft position i given
                                                       positions < i accepted (Leviathan et al. 2023,
                                                       eq. 1, with a rate per position)
    time(k_t) = verify(T0 + k_t + 1) + draft(k_t) + commit
    k_t = argmax (R + E(k_t)) / time(k_t)

- a_i: the request's own counts (decayed by ACCEPT_DECAY per judged step, so it follows the text
  it is on), behind PRIOR_WEIGHT pseudo-steps of the drafter's history across requests
  (Laplace-smoothed), kept per drafter and acceptance rule (greedy rows, Gumbel-coupled rows).
- R: the other decode rows of the verify batch, one token each at least (a row's drafts make the
  whole batch's step slower, so at batch > 1 a draft must pay for the step time of every row, not
  only its own: at batch 1, R = 0 and this is the row's own rate).
- Costs are measured wall-clock seconds, bus round trips included: verify by the verifier batch's
  total new tokens T (T0 = the tokens of the rows planned before this one and one per decode row
  planned after it: at batch 1, T = k_t + 1),
  draft by the drafter batch's largest k (only what k_t adds to the rows planned before it; 0 drafts
  send no draft request at all), the commit as a constant. Each is the least of the last
  COST_SAMPLES timings; sizes not measured are interpolated between measured ones. A verify batch
  with a tree row is timed in a table of its own (tree_choice.py: a tree forward's token costs
  more than a chain's).
- Measure first: while a batch-1 size in [0, k] has fewer than MIN_SAMPLES timings, a row alone in
  its batch takes the largest such k_t; a row in a larger batch takes k while nothing is measured
  (so a scheduler that is told no timings runs at k, as without this).
- Probe: after probe_steps steps at k_t = 0 the row choosing the next one takes k_t = 1 once, so
  a drafter that got better is noticed; after each probe with nothing accepted the next one waits
  twice as long (at most MAX_PROBE_BACKOFF times). Steps and failed probes are counted per
  drafter and acceptance rule (the prior's key), across its requests, a scheduler step once however
  many of its rows are at k_t = 0 (a probe costs its batch a draft round trip and a forward, so at
  batch 16 probing per row step would probe in every step): a new request of a useless
  drafter does not pay the short first intervals again, short requests still probe (the count
  runs on across them), and one probe accepted by any request brings the interval back to
  probe_steps.

Plain logic, no clocks: the scheduler's step planner (step_planner.py) asks `choose`, tells `verified` and the
timings. Only rows whose output cannot depend on k use it: greedy and Gumbel-coupled rows.
"""

from collections import deque
from dataclasses import dataclass, field

ACCEPT_DECAY = 0.9  # a request's own acceptance counts: the weight left to the past per judged step
PRIOR_WEIGHT = 4.0  # pseudo-steps of the drafter's history behind a request's own counts
PRIOR_MAX_STEPS = 1000.0  # the drafter's history is halved past this, so it follows a drift
# Timings kept per size; the estimate is their least. A size is timed only while it is chosen, so
# its timings may come from another minute of a machine whose speed drifts with other work (a
# median can rank a larger size cheaper than a smaller one, ops/bench/RESULTS.md "Adaptive
# speculation length"): the least of a few is what the size costs on this machine unhindered,
# comparable between sizes timed apart, and passes over a cold or stalled step.
COST_SAMPLES = 5
MIN_SAMPLES = 3  # a batch-1 size with fewer timings is measured before it is trusted
MAX_PROBE_BACKOFF = 8  # a request probes at least every MAX_PROBE_BACKOFF * probe_steps steps at k_t = 0


@dataclass
class AcceptanceCounts:
    """Per draft position i (0-based): judged[i], steps whose draft i was compared with the
    target's token (drafts < i accepted); accepted[i], those where it was accepted."""

    judged: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int, decay: float = 1.0) -> None:
        """A step with num_draft drafts of which the first num_accepted were accepted."""
        while len(self.judged) < num_draft:
            self.judged.append(0.0)
            self.accepted.append(0.0)
        for i in range(min(num_accepted + 1, num_draft)):
            self.judged[i] = decay * self.judged[i] + 1.0
            self.accepted[i] = decay * self.accepted[i] + (i < num_accepted)

    def rate(self, i: int, prior_rate: float = 0.5, prior_weight: float = 2.0) -> float:
        """a_i: these counts behind prior_weight pseudo-steps at prior_rate (Laplace's rule by default)."""
        judged, accepted = (self.judged[i], self.accepted[i]) if i < len(self.judged) else (0.0, 0.0)
        return (accepted + prior_weight * prior_rate) / (judged + prior_weight)


@dataclass
class RowState:
    """One request's part: its own acceptance, decayed (ACCEPT_DECAY), and whether its step in
    flight is a probe."""

    acceptance: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    probing: bool = False


def expected_tokens(acceptance: list[float], k: int) -> float:
    """1 + sum_{j=1..k} prod_{i<=j} a_i: tokens a step with k drafts emits on average."""
    total, reach = 1.0, 1.0
    for a in acceptance[:k]:
        reach *= a
        total += reach
    return total


class CostTable:
    """Recent timings (seconds) by an integer size: the least of the last COST_SAMPLES at a size;
    between measured sizes linear, beyond them the nearest measured one; None when empty."""

    def __init__(self) -> None:
        self.samples: dict[int, deque] = {}

    def add(self, size: int, seconds: float) -> None:
        self.samples.setdefault(size, deque(maxlen=COST_SAMPLES)).append(seconds)

    def known(self, size: int) -> bool:
        return len(self.samples.get(size, ())) >= MIN_SAMPLES

    def estimate(self, size: int) -> float | None:
        if size in self.samples:
            return min(self.samples[size])
        below = max((s for s in self.samples if s < size), default=None)
        above = min((s for s in self.samples if s > size), default=None)
        if below is None or above is None:
            nearest = above if below is None else below
            return None if nearest is None else min(self.samples[nearest])
        low, high = min(self.samples[below]), min(self.samples[above])
        return low + (high - low) * (size - below) / (above - below)


class AdaptiveK:
    """The scheduler's measured costs (per verifier and per drafter) and drafters' histories."""

    def __init__(self, probe_steps: int):
        self.probe_steps = probe_steps
        self.verify_costs: dict[str, CostTable] = {}
        self.tree_verify_costs: dict[str, CostTable] = {}  # batches with a tree row (tree_choice.py)
        self.draft_costs: dict[str, CostTable] = {}
        self.commit_s = CostTable()  # one size, 0
        self.priors: dict[tuple[str, str], AcceptanceCounts] = {}
        # by prior key: steps at k_t = 0 since the last probe, and probes in a row with nothing accepted
        self.zero_steps: dict[tuple[str, str], int] = {}
        self.failed_probes: dict[tuple[str, str], int] = {}
        self.counted_step: dict[tuple[str, str], int] = {}  # the step whose k_t = 0 was counted last

    def choose(self, row: RowState, prior_key: tuple[str, str], k_max: int, verifier_id: str,
               base_tokens: int, drafter_id: str, base_k: int, alone: bool, others: int = 0,
               step: int | None = None) -> int:
        """k_t in [0, k_max] for a row whose verify batch holds base_tokens new tokens besides its
        own and others decode rows besides it, and whose drafter batch already asks base_k drafts;
        alone: the only row of its verify batch (batch 1: where sizes are measured first). Counts
        steps at 0 towards the drafter's next probe, the scheduler step `step` once (None: each
        call is a step)."""
        k = self.best_k(row.acceptance, prior_key, k_max, verifier_id, base_tokens, drafter_id, base_k, alone,
                        others)
        backoff = min(2 ** self.failed_probes.get(prior_key, 0), MAX_PROBE_BACKOFF)
        counted = step is not None and self.counted_step.get(prior_key) == step
        zero_steps = self.zero_steps.get(prior_key, 0) + (k == 0 and not counted)
        if k == 0 and step is not None:
            self.counted_step[prior_key] = step
        row.probing = k == 0 and zero_steps >= self.probe_steps * backoff
        if row.probing:
            k, zero_steps = min(1, k_max), 0
        self.zero_steps[prior_key] = zero_steps
        return k

    def best_k(self, own: AcceptanceCounts, prior_key: tuple[str, str], k_max: int, verifier_id: str,
               base_tokens: int, drafter_id: str, base_k: int, alone: bool, others: int = 0) -> int:
        """The argmax of (others + E(k))/time(k), or the size to measure first (module docstring)."""
        return self.best(own, prior_key, k_max, verifier_id, base_tokens, drafter_id, base_k, alone, others)[0]

    def best(self, own: AcceptanceCounts, prior_key: tuple[str, str], k_max: int, verifier_id: str,
             base_tokens: int, drafter_id: str, base_k: int, alone: bool, others: int = 0) -> tuple[int, float | None]:
        """best_k's k and its expected tokens per second; None for a size measured first, or k_max
        with nothing measured."""
        if alone:
            unmeasured = self.unmeasured(k_max, verifier_id, drafter_id)
            if unmeasured:
                return unmeasured[-1], None
        prior = self.priors.get(prior_key, AcceptanceCounts())
        acceptance = [own.rate(i, prior.rate(i), PRIOR_WEIGHT) for i in range(k_max)]
        best, best_rate = 0, 0.0
        for k in range(k_max + 1):
            rate = self.step_rate(expected_tokens(acceptance, k), others, verifier_id, base_tokens + k + 1,
                                  drafter_id, k, base_k)
            if rate is None:
                return k_max, None  # nothing measured (unit tests, a scheduler whose service reports no timings)
            if rate > best_rate:
                best, best_rate = k, rate
        return best, best_rate

    def unmeasured(self, k_max: int, verifier_id: str, drafter_id: str) -> list[int]:
        """The batch-1 sizes k in [0, k_max] with fewer than MIN_SAMPLES timings (verify at k + 1
        tokens, draft at k)."""
        verify = self.verify_costs.setdefault(verifier_id, CostTable())
        draft = self.draft_costs.setdefault(drafter_id, CostTable())
        return [k for k in range(k_max + 1) if not verify.known(k + 1) or (k and not draft.known(k))]

    def step_rate(self, expected: float, others: int, verifier_id: str, tokens: int, drafter_id: str, draft_k: int,
                  base_k: int, tree: bool = False) -> float | None:
        """(others + expected) / time of a step whose verify batch holds `tokens` new tokens (tree: a
        tree row among them, timed apart while any such batch is) and asks its drafter for draft_k
        drafts where the rows planned before asked base_k; None while nothing is measured."""
        verify_s = self.tree_verify_costs.get(verifier_id, CostTable()).estimate(tokens) if tree else None
        if verify_s is None:
            verify_s = self.verify_costs.get(verifier_id, CostTable()).estimate(tokens)
        draft = self.draft_costs.get(drafter_id, CostTable())
        draft_s = draft.estimate(draft_k) if draft_k > base_k else 0.0
        if verify_s is None or draft_s is None:
            return None
        if draft_k > base_k and base_k:
            draft_s -= draft.estimate(base_k)  # what draft_k adds to the drafter batch's rows planned before
        commit_s = self.commit_s.estimate(0) or 0.0
        return (others + expected) / max(verify_s + draft_s + commit_s, 1e-9)

    def verified(self, row: RowState, prior_key: tuple[str, str], num_draft: int, num_accepted: int) -> None:
        """A verify step of a row with num_draft drafts, num_accepted of them accepted."""
        row.acceptance.record(num_draft, num_accepted, ACCEPT_DECAY)
        if row.probing:
            self.failed_probes[prior_key] = 0 if num_accepted else self.failed_probes.get(prior_key, 0) + 1
            row.probing = False
        prior = self.priors.setdefault(prior_key, AcceptanceCounts())
        prior.record(num_draft, num_accepted)
        if prior.judged and prior.judged[0] > PRIOR_MAX_STEPS:
            prior.judged = [n / 2 for n in prior.judged]
            prior.accepted = [n / 2 for n in prior.accepted]

    def draft_timed(self, drafter_id: str, max_k: int, seconds: float) -> None:
        self.draft_costs.setdefault(drafter_id, CostTable()).add(max_k, seconds)

    def verify_timed(self, verifier_id: str, num_tokens: int, seconds: float, commit_s: float,
                     tree: bool = False) -> None:
        """A verify batch of num_tokens new tokens; tree: with a tree row (its own table, tree_choice.py)."""
        costs = self.tree_verify_costs if tree else self.verify_costs
        costs.setdefault(verifier_id, CostTable()).add(num_tokens, seconds)
        self.commit_s.add(0, commit_s)
