"""Recovery: what the scheduler does when an instance a request is pinned to dies or fails it.
No NATS, no awaits: services/scheduler/scheduler_core.py owns one `Recovery` and calls it at
every step boundary and when a verify batch got no answer, with the tables it reads (its running
requests, the ids in a step, ended requests kept for a replay) as arguments; each call returns
`Changes` (scheduler_types.py: what to count, which requests end, what to forget) that the core
applies.

- A dead drafter is replaced by the core at the boundary (draft_method.py chooses another
  compatible one, which gets the whole history: Request.restart_drafter).
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

from collections.abc import Callable, Iterator, Mapping, Set

import numpy as np
import structlog

from schemas.config import SchedulerConfig
from schemas.commits import Commit
from services.scheduler.commits import count_degraded, direct_final_chunk
from services.scheduler.placement import Placement
from services.scheduler.scheduler_types import Changes, Ending, Request, StepPlan
from services.scheduler.slot_release import SlotReleases

log = structlog.get_logger(__name__)


class Recovery:
    """Replacements, replays and migrations (module docstring). pinned_count(instance_id), an
    argument where an instance is picked, counts the scheduler's running requests on an instance."""

    def __init__(self, config: SchedulerConfig, placement: Placement, releases: SlotReleases):
        self.config = config
        self.placement = placement
        self.releases = releases

    def replace_dead(self, request: Request, pinned_count: Callable[[str], int]) -> Changes:
        """A dead postprocessor replaced (its commits replayed), a dead verifier left for another."""
        changes = Changes()
        if not self.placement.alive(request.postprocessor_id):
            changes.outbox.commits += self.repin_postprocessor(request, pinned_count, changes)
        if not self.placement.alive(request.verifier_id):
            self.migrate(request, pinned_count, changes)
        return changes

    def repin_postprocessor(self, request: Request, pinned_count: Callable[[str], int],
                            changes: Changes) -> list[tuple[str, Commit]]:
        """Move the request to a live postprocessor and replay its recent commits there; [] when
        there is none (it waits, up to its deadline)."""
        new_id = self.placement.pick("postprocessor", pinned_count)
        if new_id is None:
            return []
        log.warning("postprocessor_replaced", request_id=request.request_id, old=request.postprocessor_id,
                    new=new_id, replayed=len(request.sent))
        request.postprocessor_id = self.placement.count_pin(new_id)
        changes.counts["postprocessor_repinned"] += 1
        return [(new_id, commit) for commit in self.replay(request)]

    def replay_lost_finals(self, finishing: Mapping[str, tuple[Request, float]], now: float,
                           pinned_count: Callable[[str], int]) -> Changes:
        """A final commit sent just before its postprocessor died is lost with it, and a dead
        postprocessor is only noticed heartbeat_timeout_s later: ended requests are kept that long
        (twice, for margin: finishing, Committer's) and their commits replayed to another
        postprocessor if need be (Changes.forget: those kept no more). A request that ended with
        its postprocessor known dead waits for one up to its deadline (now: time.time()), then
        gets a final `timeout` chunk straight from here."""
        changes = Changes()
        window = 2 * self.config.heartbeat_timeout_s
        for request_id, (request, ended_at) in finishing.items():
            if request.awaiting_postprocessor and now >= request.deadline:  # none came in time
                changes.forget.append(request_id)
                changes.outbox.chunks.append((request.client_inbox, direct_final_chunk(request, "timeout")))
            elif not request.awaiting_postprocessor and self.placement.monotonic() - ended_at > window:
                changes.forget.append(request_id)
            elif not self.placement.alive(request.postprocessor_id):
                replayed = self.repin_postprocessor(request, pinned_count, changes)
                if replayed:
                    changes.outbox.commits += replayed
                    changes.forget.append(request_id)
        return changes

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

    def migrate(self, request: Request, pinned_count: Callable[[str], int], changes: Changes) -> None:
        """Move to another verifier, re-prefilled from history; none with room: start over on the
        same one while it still heartbeats (its replies were lost on the way, e.g. in a dead NATS
        node, more likely than the verifier), else wait, up to the deadline, for a verifier with
        room (under `specbus up`, the restart of a stack's only verifier): the planner leaves a
        request whose verifier is dead alone, and each boundary tries again."""
        old_id = request.verifier_id
        new_id = self.placement.pick("verifier", pinned_count, exclude=old_id)
        new_id = new_id or (old_id if self.placement.alive(old_id) else None)
        # The failed step's number is never planned again: the old verifier may still run that
        # batch (frozen, then thawed) and would answer a new row of the same step with its stored
        # result; and whichever verifier runs the request next starts from cached_len 0.
        request.verifier_len = 0
        request.step += 1
        if new_id is None:
            if not request.awaiting_verifier:
                request.awaiting_verifier = True
                changes.counts["verifier_awaited"] += 1
                log.warning("no_verifier_to_migrate_to", request_id=request.request_id, verifier_id=old_id)
            return
        request.awaiting_verifier = False
        if new_id != old_id:
            self.releases.release(old_id, request.request_id)
            request.verifier_id = self.placement.count_pin(new_id)
        request.carried_degraded.append("migrated")
        count_degraded(request, ["migrated"], changes.counts)
        changes.counts["migrated"] += 1
        log.warning("request_migrated", request_id=request.request_id, old=old_id, new=new_id)

    def verifier_failed(self, verifier_id: str, now: float, plan: StepPlan, running: list[Request],
                        in_flight: Set[str], pinned_count: Callable[[str], int]) -> Iterator[Changes]:
        """A batch was not answered after the retry: avoid that verifier for a while and move
        every request pinned to it (of running, the core's running requests), but those in
        another lane's step in flight (that lane moves them when its own batch fails). One
        `Changes` per request, each applied by the core before the next request moves."""
        self.placement.avoid(verifier_id)
        ours = {planned.request.request_id for planned in plan.rows.get(verifier_id, [])}
        for request in [r for r in running if r.verifier_id == verifier_id
                        and (r.request_id in ours or r.request_id not in in_flight)]:
            changes = Changes()
            if now >= request.deadline:
                changes.ended.append(Ending(request, "timeout"))
            else:
                self.migrate(request, pinned_count, changes)
            yield changes
