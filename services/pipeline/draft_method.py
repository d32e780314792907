"""Which drafter a request drafts with: its SpeculativeOptions.draft_method against the drafters
alive (docs/PROTOCOL.md#draft-methods). No NATS, no awaits: scheduler_core.py calls
`pin_drafter` where it pins a drafter (start, a dead drafter replaced) and `drafted` once a
step whose drafts a drafter answered is verified.

A drafter's method is its heartbeat's model_ids["draft_method"]: "ngram" (prompt lookup,
gpu_worker/ngram.py) or "model" (also when absent: drafters from before the field).

- "model" / "ngram": only drafters of that method; none live: the request runs k=0 flagged
  draft_timeout, as without any drafter.
- "auto", measured per request: with one method live it uses that one (no model drafter
  registered: prompt lookup). With both live it tries ngram for TRIAL_STEPS answered steps
  (first, since its slot costs nothing to fill), then a model drafter for TRIAL_STEPS, then keeps
  the method whose drafts were accepted more per step (mean accepted draft tokens per answered
  step: a step where the ngram drafter found no match counts as 0; a tie goes to ngram, which
  costs no forward). The slot on the drafter it leaves is released; the new one starts from the
  whole history (drafter_len 0). Steps without an answer (draft_timeout, resync) do not count.
  Once settled, a replaced drafter is of the chosen method when one is live, else the other.
"""

from collections import Counter
from dataclasses import dataclass, field

from schemas.messages import Heartbeat

TRIAL_STEPS = 8
METHODS = ("ngram", "model")  # "auto"'s trial order


def method_of(heartbeat: Heartbeat) -> str:
    return heartbeat.model_ids.get("draft_method", "model")


@dataclass
class DraftTrial:
    """An "auto" request's measurements: answered steps and accepted draft tokens per method."""

    steps: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)
    settled: str | None = None  # the method chosen once both were tried

    def rate(self, method: str) -> float:
        return self.accepted[method] / self.steps[method] if self.steps[method] else 0.0

    def wanted(self) -> str:
        """The method to use next: the settled one, else the first not tried for TRIAL_STEPS."""
        if self.settled is not None:
            return self.settled
        return next((m for m in METHODS if self.steps[m] < TRIAL_STEPS), METHODS[-1])


def other(method: str) -> str:
    return METHODS[1 - METHODS.index(method)]


def pick_method(state, method: str) -> str | None:
    """A live compatible drafter of `method` with room (Placement.pick), not counted as pinned."""
    return state.placement.pick("drafter", state.pinned_count, accept=lambda beat: method_of(beat) == method)


def pin_drafter(state, request) -> str | None:
    """The drafter for a request (module docstring), counted as a pin; None when none fits.
    state: the SchedulerState; request: its Request."""
    method = request.speculative.draft_method
    if method != "auto":
        return state.placement.count_pin(pick_method(state, method))
    wanted = request.draft_trial.wanted()
    return state.placement.count_pin(pick_method(state, wanted) or pick_method(state, other(wanted)))


def drafted(state, request, drafter_id: str, num_accepted: int) -> None:
    """Count a verified step drafted by drafter_id for an "auto" request and move it to the other
    method when its trial says so (module docstring)."""
    instance = state.placement.registry.instances.get(drafter_id)
    if request.speculative.draft_method != "auto" or instance is None:
        return
    trial = request.draft_trial
    current = method_of(instance.info)
    trial.steps[current] += 1
    trial.accepted[current] += num_accepted
    if trial.settled is None and all(trial.steps[m] >= TRIAL_STEPS for m in METHODS):
        trial.settled = max(METHODS, key=lambda m: (trial.rate(m), m == "ngram"))
        state.counters[f"draft_method_chose_{trial.settled}"] += 1
    wanted = trial.wanted()
    if wanted == current or request.drafter_id != drafter_id:
        return
    new_id = pick_method(state, wanted)
    if new_id is None:  # none live with room: stay, and ask again after the next step
        return
    state.release(request.drafter_id, request.request_id)
    request.drafter_id, request.drafter_len = state.placement.count_pin(new_id), 0
    state.counters["draft_method_switches"] += 1
