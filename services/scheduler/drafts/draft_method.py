"""Which drafter a request drafts with: its SpeculativeOptions.draft_method against the drafters
alive (docs/PROTOCOL.md#draft-methods). No NATS, no awaits: the scheduler's core
(scheduler_core.py) calls `pin_drafter` where it pins a drafter (start, and the replacement of a
dead one) and `drafted` once a step whose drafts a drafter answered is verified. Both get what
they read as arguments (the core's Placement, and pinned_count: its running requests on an
instance) and change nothing of the core: they return the drafter chosen (`DraftSwitch` for
`drafted`, with what to count), and the core pins it; only the request's own trial
(Request.draft_trial) is kept here.

A drafter's method is its heartbeat's model_ids["draft_method"]: "ngram" (prompt lookup,
gpu_worker/drafter/ngram.py), "eagle" (an EAGLE head over the target's features,
gpu_worker/drafter/eagle_drafter.py) or "model" (also when absent: drafters from before the field). An
eagle drafter fits only requests whose verifier serves the target it was trained for (its
heartbeat's model_ids["target"] is the verifier's): it drafts from that target's features.

- "model" / "ngram" / "eagle": only drafters of that method; none live: the request runs k=0
  flagged draft_timeout, as without any drafter.
- "suffix": no drafter (the scheduler's suffix index drafts, services/scheduler/drafts/suffix_choice.py).
- "auto", measured per request: with one method live it uses that one. With several live it
  tries each for TRIAL_STEPS answered steps, in METHODS order (cheapest first: ngram's slot
  costs nothing to fill, an eagle head's one layer little), then keeps the method whose drafts
  were accepted most per step (mean accepted draft tokens per answered step: a step where the
  ngram drafter found no match counts as 0; a tie goes to the earlier method). The slot on the
  drafter it leaves is released; the new one starts from the whole history (drafter_len 0, and
  for an eagle drafter the features from position 0). Steps without an answer (draft_timeout,
  resync) do not count. Once settled, a replaced drafter is of the chosen method when one is
  live, else of another.
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.bus.control import Heartbeat
from schemas.draft_kinds import AUTO_TRIAL_ORDER, DEFAULT_DRAFT_METHOD, DRAFT_KINDS, proposes_in_scheduler
from services.scheduler.placement import Placement

TRIAL_STEPS = 8
METHODS = AUTO_TRIAL_ORDER  # "auto"'s trial order, and its order of preference on a tie


def method_of(heartbeat: Heartbeat) -> str:
    return heartbeat.model_ids.get("draft_method", DEFAULT_DRAFT_METHOD)


@dataclass
class DraftTrial:
    """An "auto" request's measurements: answered steps and accepted draft tokens per method."""

    steps: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)
    settled: str | None = None  # the method chosen once every live one was tried

    def rate(self, method: str) -> float:
        return self.accepted[method] / self.steps[method] if self.steps[method] else 0.0

    def best(self, methods: list[str]) -> str:
        """The method of methods accepted most per step; a tie goes to the earlier in METHODS."""
        return max(methods, key=lambda m: (self.rate(m), -METHODS.index(m)))

    def wanted(self, live: list[str]) -> str | None:
        """The method to use next, of the live ones: the settled one, else the first not tried for
        TRIAL_STEPS, else the best; None when none is live."""
        if self.settled in live:
            return self.settled
        untried = [m for m in live if self.steps[m] < TRIAL_STEPS]
        return untried[0] if untried else (self.best(live) if live else None)


def fits(placement: Placement, request, method: str):
    """The heartbeat filter of drafters of method that can draft for request: one of a kind that
    fits only its own target (an eagle drafter, schemas/draft_kinds.py) only for the target of the
    request's verifier."""
    if DRAFT_KINDS[method].fits != "target":
        return lambda beat: method_of(beat) == method
    verifier = placement.registry.instances.get(request.verifier_id) if request.verifier_id else None
    target = None if verifier is None else verifier.info.model_ids.get("target")
    return lambda beat: method_of(beat) == method and target is not None and beat.model_ids.get("target") == target


def pick_method(placement: Placement, pinned_count: Callable[[str], int], request, method: str) -> str | None:
    """A live compatible drafter of `method` for request with room (Placement.pick), not counted
    as pinned."""
    return placement.pick("drafter", pinned_count, accept=fits(placement, request, method))


def live_methods(placement: Placement, request) -> list[str]:
    """The methods with a live compatible drafter for request, in METHODS order."""
    return [m for m in METHODS if placement.compatible("drafter", accept=fits(placement, request, m))]


@dataclass
class DraftSwitch:
    """What a verified drafted step decided (`drafted`): counters to add, and the drafter to move
    the request to (None: it stays), not yet pinned."""

    counts: Counter = field(default_factory=Counter)
    drafter_id: str | None = None


def pin_drafter(placement: Placement, pinned_count: Callable[[str], int], request) -> str | None:
    """The drafter for a request (a scheduler_types.Request; module docstring), not counted as a
    pin (the caller pins it); None when none fits."""
    method = request.speculative.draft_method
    if proposes_in_scheduler(method):
        return None
    if method != "auto":
        return pick_method(placement, pinned_count, request, method)
    wanted = request.draft_trial.wanted(live_methods(placement, request))
    others = [m for m in METHODS if m != wanted]
    return next((d for m in [wanted, *others]
                 if m is not None and (d := pick_method(placement, pinned_count, request, m))), None)


def drafted(placement: Placement, pinned_count: Callable[[str], int], request, drafter_id: str,
            num_accepted: int) -> DraftSwitch:
    """Count a verified step drafted by drafter_id in an "auto" request's trial, and the drafter
    of another method to move it to when its trial says so (module docstring)."""
    switch = DraftSwitch()
    instance = placement.registry.instances.get(drafter_id)
    if request.speculative.draft_method != "auto" or instance is None:
        return switch
    trial = request.draft_trial
    current = method_of(instance.info)
    trial.steps[current] += 1
    trial.accepted[current] += num_accepted
    live = live_methods(placement, request)
    if trial.settled is None and len(live) > 1 and all(trial.steps[m] >= TRIAL_STEPS for m in live):
        trial.settled = trial.best(live)
        switch.counts[f"draft_method_chose_{trial.settled}"] += 1
    wanted = trial.wanted(live)
    if wanted is None or wanted == current or request.drafter_id != drafter_id:
        return switch
    # None (none live with room): it stays, and asks again after the next step
    switch.drafter_id = pick_method(placement, pinned_count, request, wanted)
    if switch.drafter_id is not None:
        switch.counts["draft_method_switches"] += 1
    return switch
