"""Recovery: what the scheduler does when an instance a request is pinned to dies or fails it.
No NATS, no awaits: services/scheduler/scheduler_core.py owns one `Recovery` and calls it at
every step boundary and when a verify batch got no answer.

- A dead drafter is replaced by another compatible one (draft_method.py), which gets the whole
  history (Request.restart_drafter).
- A dead postprocessor is replaced and the request's recent commits are replayed to the new one
  (`repin_postprocessor`, `replay`): commits are fire-and-forget, so which ones reached the
  client is not known; the first replay carries resume_token_ids (the completion before it),
  the client drops the seqs it already has, and replays expect no side channel (the records
  went to the dead one: one that expected it is flagged logprobs_timeout). Requests that ended
  just before their postprocessor died are replayed the same way (`replay_lost_finals`).
- A dead verifier, or one that did not answer a batch after the retry: every request on it
  moves to another verifier and is re-prefilled from its history (`migrate`, flagged
  `migrated`); with no other verifier with room it starts over on the same one while that one
  heartbeats, else it waits, up to its deadline, for one. A verifier that failed a batch is
  avoided for heartbeat_timeout_s.
"""

from collections import Counter
from collections.abc import Callable

import numpy as np
import structlog

from schemas.config import SchedulerConfig
from schemas.commits import Commit
from services.scheduler.commits import Committer
from services.scheduler.placement import Placement
from services.scheduler.scheduler_types import Outbox, Request, StepPlan
from services.scheduler.slot_release import SlotReleases

log = structlog.get_logger(__name__)


class Recovery:
    """Replacements, replays and migrations (module docstring). pin_drafter(request) pins a
    new drafter for a request (draft_method.pin_drafter), pinned_count(instance_id) counts the
    scheduler's running requests on an instance."""

    def __init__(self, config: SchedulerConfig, placement: Placement, running: dict[str, Request],
                 in_flight: set[str], releases: SlotReleases, committer: Committer, counters: Counter,
                 pin_drafter: Callable[[Request], str | None], pinned_count: Callable[[str], int]):
        self.config = config
        self.placement = placement
        self.running = running
        self.in_flight = in_flight
        self.releases = releases
        self.committer = committer
        self.counters = counters
        self.pin_drafter = pin_drafter
        self.pinned_count = pinned_count

    def replace_dead(self, request: Request, now: float) -> Outbox:
        outbox = Outbox()
        if not self.placement.alive(request.postprocessor_id):
            outbox.commits += self.repin_postprocessor(request)
        if request.speculative.num_speculative_tokens > 0 and not self.placement.alive(request.drafter_id):
            request.drafter_id = self.pin_drafter(request)
            request.restart_drafter()
        if not self.placement.alive(request.verifier_id):
            self.migrate(request)
        return outbox

    def repin_postprocessor(self, request: Request) -> list[tuple[str, Commit]]:
        """Move the request to a live postprocessor and replay its recent commits there; [] when
        there is none (it waits, up to its deadline)."""
        new_id = self.placement.pick("postprocessor", self.pinned_count)
        if new_id is None:
            return []
        log.warning("postprocessor_replaced", request_id=request.request_id, old=request.postprocessor_id,
                    new=new_id, replayed=len(request.sent))
        request.postprocessor_id = self.placement.count_pin(new_id)
        self.counters["postprocessor_repinned"] += 1
        return [(new_id, commit) for commit in self.replay(request)]

    def replay_lost_finals(self, now: float) -> Outbox:
        """A final commit sent just before its postprocessor died is lost with it, and a dead
        postprocessor is only noticed heartbeat_timeout_s later: keep ended requests that long
        (twice, for margin) and replay their commits to another postprocessor if need be. A
        request that ended with its postprocessor known dead waits for one up to its deadline
        (now: time.time()), then gets a final `timeout` chunk straight from here."""
        outbox = Outbox()
        window = 2 * self.config.heartbeat_timeout_s
        finishing = self.committer.finishing
        for request_id, (request, ended_at) in list(finishing.items()):
            if request.awaiting_postprocessor and now >= request.deadline:  # none came in time
                del finishing[request_id]
                outbox.chunks.append((request.client_inbox, self.committer.direct_final_chunk(request, "timeout")))
            elif not request.awaiting_postprocessor and self.committer.monotonic() - ended_at > window:
                del finishing[request_id]
            elif not self.placement.alive(request.postprocessor_id):
                replayed = self.repin_postprocessor(request)
                if replayed:
                    outbox.commits += replayed
                    del finishing[request_id]
        return outbox

    @staticmethod
    def replay(request: Request) -> list[Commit]:
        replays = []
        for index, (commit, completion_len, _) in enumerate(request.sent):
            update = {"expect_side_channel": False}
            if commit.expect_side_channel:
                update["degraded"] = list(dict.fromkeys([*commit.degraded, "logprobs_timeout"]))
            if index == 0:
                update["resume_token_ids"] = np.array(request.completion[:completion_len], dtype=np.int32)
            replays.append(commit.model_copy(update=update))
        return replays

    def migrate(self, request: Request) -> None:
        """Move to another verifier, re-prefilled from history; none with room: start over on the
        same one while it still heartbeats (its replies were lost on the way, e.g. in a dead NATS
        node, more likely than the verifier), else wait, up to the deadline, for a verifier with
        room (under `specbus up`, the restart of a stack's only verifier): the planner leaves a
        request whose verifier is dead alone, and each boundary tries again."""
        old_id = request.verifier_id
        new_id = self.placement.pick("verifier", self.pinned_count, exclude=old_id)
        new_id = new_id or (old_id if self.placement.alive(old_id) else None)
        # The failed step's number is never planned again: the old verifier may still run that
        # batch (frozen, then thawed) and would answer a new row of the same step with its stored
        # result; and whichever verifier runs the request next starts from cached_len 0.
        request.verifier_len = 0
        request.step += 1
        if new_id is None:
            if not request.awaiting_verifier:
                request.awaiting_verifier = True
                self.counters["verifier_awaited"] += 1
                log.warning("no_verifier_to_migrate_to", request_id=request.request_id, verifier_id=old_id)
            return
        request.awaiting_verifier = False
        if new_id != old_id:
            self.releases.release(old_id, request.request_id)
            request.verifier_id = self.placement.count_pin(new_id)
        request.carried_degraded.append("migrated")
        self.committer.count_degraded(request, ["migrated"])
        self.counters["migrated"] += 1
        log.warning("request_migrated", request_id=request.request_id, old=old_id, new=new_id)

    def verifier_failed(self, verifier_id: str, now: float, plan: StepPlan) -> Outbox:
        """A batch was not answered after the retry: avoid that verifier for a while and move
        every request pinned to it, but those in another lane's step in flight (that lane moves
        them when its own batch fails)."""
        self.placement.avoid(verifier_id)
        ours = {planned.request.request_id for planned in plan.rows.get(verifier_id, [])}
        outbox = Outbox()
        for request in [r for r in self.running.values() if r.verifier_id == verifier_id
                        and (r.request_id in ours or r.request_id not in self.in_flight)]:
            if now >= request.deadline:
                outbox.extend(self.committer.end(request, "timeout", now))
            else:
                self.migrate(request)
        return outbox
