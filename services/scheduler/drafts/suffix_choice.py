"""The hybrid: per decode row and step, the suffix index's drafts (suffix_index.py) where their
expected tokens per second beat the drafter's (a draft model's, an EAGLE head's, prompt
lookup's), else the drafter's, else none: adaptive k's rule (adaptive_k.py), over its costs.

    suffix n:  (R + 1 + c * sum_{i<n} q_i) / (verify(T0 + n + 1) + commit)
    drafter:   adaptive k's best chain, k_t = 0 included (its draft round trip counted)

- q_i: the index's probability that drafts 0..i are all accepted (the fraction of the earlier
  occurrences that went on the same way), so the sum is the proposal's expected accepted drafts.
  c: the measured ratio of accepted to expected drafts of the tenant's suffix steps whose match
  was as long (MATCH_BUCKETS), decayed by CALIBRATION_DECAY per step, behind CALIBRATION_PRIOR
  pseudo-drafts at the bucket's PRIOR_SCALES: frequencies from a handful of occurrences are optimistic, the
  more so the shorter the match (what ArcticInference's length rule says), and this says by how
  much.
- n: the prefix of the proposal of the best rate. The proposal stops where q falls under
  MIN_TOKEN_PROB (ArcticInference's min_token_prob; its other rule, a length of at most the
  match's, is not applied: the rate already prices a long guess, ops/bench/RESULTS.md compares).
- Suffix drafts cost no drafter: the scheduler proposes them while it plans, and a step whose rows
  all take them sends no draft request. The drafter's slot falls behind meanwhile and is fed the
  missed tokens with its next draft row (the receiver rule's cached_len).
- Probe: after probe_steps rows of a tenant whose proposal lost, the next proposal is used once,
  so a calibration that fell low is measured again; a probe with nothing accepted doubles the
  wait (at most MAX_PROBE_BACKOFF times), as adaptive k's.
- Who: greedy and Gumbel-coupled rows (their tokens do not depend on the drafts: a suffix draft is
  a point mass, exact for both), of requests whose draft_method is "auto" or "suffix". A
  rejection-sampled row's draws depend on its drafts, and a seeded one must draw the same tokens
  again whatever other requests the index saw, so it never takes them. "suffix" requests have no
  drafter: the index's drafts or none.
- With adaptive_k off every row takes its k: a row with a live drafter takes the drafter's, a
  "suffix" row (or one without a drafter) the index's whole proposal.

Calibrations and probes are per tenant (with a shared pool, one for all), so one tenant's traffic
never changes another's drafts. Plain logic, no clocks: the step planner asks `choose` and tells
`verified`.
"""

from dataclasses import dataclass, field

from services.scheduler.drafts.adaptive_k import MAX_PROBE_BACKOFF, AdaptiveK
from services.scheduler.drafts.suffix_index import SuffixPools
from services.scheduler.drafts.tree_choice import RowPlace

MIN_TOKEN_PROB = 0.1  # a draft whose path probability falls under this ends the proposal
MATCH_BUCKETS = (1, 2, 4, 8)  # match lengths calibrated apart: the least of each bucket
CALIBRATION_DECAY = 0.95  # the weight left to the past per suffix step
CALIBRATION_PRIOR = 4.0  # pseudo expected drafts behind a tenant's own
# ... at this ratio of accepted to expected drafts, by match bucket: what an offline replay of
# held-out chat and HumanEval measured (ops/bench/RESULTS.md "Suffix decoding")
PRIOR_SCALES = {1: 0.2, 2: 0.2, 4: 0.3, 8: 0.5}


@dataclass
class Calibration:
    """A tenant's suffix steps for one acceptance rule and match bucket: its prior ratio, expected
    and accepted drafts (decayed), the rows whose proposal lost since one was used, and the probes
    in a row with nothing accepted."""

    prior_scale: float = PRIOR_SCALES[MATCH_BUCKETS[0]]
    expected: float = 0.0
    accepted: float = 0.0
    lost: int = 0
    failed_probes: int = 0

    def scale(self) -> float:
        return (self.accepted + CALIBRATION_PRIOR * self.prior_scale) / (self.expected + CALIBRATION_PRIOR)

    def record(self, expected: float, accepted: int) -> None:
        self.expected = CALIBRATION_DECAY * self.expected + expected
        self.accepted = CALIBRATION_DECAY * self.accepted + accepted


@dataclass
class SuffixStep:
    """A planned row's suffix drafts: their expected accepted drafts (uncalibrated), whose
    calibration they count in, and whether the row is a probe."""

    expected: float
    key: tuple[str, str, int]  # (tenant, acceptance rule, match bucket)
    probe: bool = False


@dataclass
class SuffixChoice:
    """The scheduler's suffix pools and calibrations (module docstring); adaptive None: adaptive_k off."""

    pools: SuffixPools
    adaptive: AdaptiveK | None
    probe_steps: int
    calibrations: dict[tuple[str, str, int], Calibration] = field(default_factory=dict)

    @staticmethod
    def eligible(request) -> bool:
        sampling = request.sampling
        return request.speculative.draft_method in ("auto", "suffix") and (sampling.greedy or sampling.gumbel)

    def choose(self, request, wanted: int, place: RowPlace, drafter: bool,
               prior_key: tuple[str, str]) -> tuple[list[int], SuffixStep] | None:
        """The drafts a decode row takes from the index, at most wanted, and their SuffixStep; None:
        the drafter's draft (or none). drafter: a live drafter could draft the row, whose adaptive k
        acceptance is kept under prior_key."""
        if not (wanted and self.eligible(request)):
            return None
        proposal = self.pools.propose(request.request_id, request.user, request.history, wanted, MIN_TOKEN_PROB)
        if not proposal.token_ids:
            return None
        bucket = max(b for b in MATCH_BUCKETS if b <= max(proposal.match_len, 1))
        key = (self.pools.tenant(request.user), "greedy" if request.sampling.greedy else "gumbel", bucket)
        calibration = self.calibrations.setdefault(key, Calibration(PRIOR_SCALES[bucket]))
        if self.adaptive is None:
            return None if drafter else self.taken(proposal.token_ids, proposal.probs, key)
        size, rate = self.best_size(proposal.probs, calibration.scale(), place)
        if rate is None:  # nothing timed yet: the drafter measures first, else the index's whole proposal
            return None if drafter else self.taken(proposal.token_ids, proposal.probs, key)
        if drafter:
            _, other = self.adaptive.best(request.adaptive.acceptance, prior_key, wanted, place.verifier_id,
                                          place.base_tokens, place.drafter_id, place.base_k, place.alone,
                                          place.others)
            if other is None:
                return None
        else:
            other = self.adaptive.step_rate(1.0, place.others, place.verifier_id, place.base_tokens + 1, "", 0, 0)
        if other is not None and rate <= other:
            calibration.lost += 1
            if calibration.lost < self.probe_steps * min(2 ** calibration.failed_probes, MAX_PROBE_BACKOFF):
                return None
            chosen = self.taken(proposal.token_ids[:size], proposal.probs[:size], key)
            chosen[1].probe = True
            return chosen
        return self.taken(proposal.token_ids[:size], proposal.probs[:size], key)

    def taken(self, token_ids: list[int], probs: list[float],
              key: tuple[str, str, int]) -> tuple[list[int], SuffixStep]:
        self.calibrations[key].lost = 0
        return token_ids, SuffixStep(expected=sum(probs), key=key)

    def best_size(self, probs: list[float], scale: float, place: RowPlace) -> tuple[int, float | None]:
        """The prefix of a proposal of the best expected tokens per second, and that rate (None
        while the verifier's costs are not timed)."""
        best, best_rate, expected = len(probs), None, 1.0
        for n, prob in enumerate(probs, start=1):
            expected += scale * prob
            rate = self.adaptive.step_rate(expected, place.others, place.verifier_id, place.base_tokens + n + 1, "",
                                           0, 0)
            if rate is None:
                return len(probs), None
            if best_rate is None or rate > best_rate:
                best, best_rate = n, rate
        return best, best_rate

    def verified(self, step: SuffixStep, num_accepted: int) -> None:
        """A row's suffix drafts verified, num_accepted of them accepted."""
        calibration = self.calibrations.setdefault(step.key, Calibration(PRIOR_SCALES[step.key[2]]))
        calibration.record(step.expected, num_accepted)
        if step.probe:
            calibration.failed_probes = 0 if num_accepted else calibration.failed_probes + 1

    def ended(self, request) -> None:
        """A request left the scheduler: its last tokens go into its tenant's index."""
        self.pools.ended(request.request_id, request.user, request.history)
