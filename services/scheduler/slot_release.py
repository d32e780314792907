"""Slots to free on drafters and verifiers (docs/PROTOCOL.md#slot-release): the request ids
each instance is told to release with its next batch. No NATS: the scheduler's batch builder
takes them into DraftRequest.release / VerifyRequest.release, at most MAX_BATCH_ROWS a batch.
"""

from schemas.bus.protocol import MAX_BATCH_ROWS
from services.scheduler.placement import Placement


class SlotReleases:
    """instance_id -> the request ids whose slots it should free, oldest first."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self.pending: dict[str, list[str]] = {}

    def release(self, instance_id: str | None, request_id: str) -> None:
        if instance_id is not None:
            self.pending.setdefault(instance_id, []).append(request_id)

    def take(self, instance_id: str) -> list[str]:
        """The releases for instance_id's next batch (the oldest MAX_BATCH_ROWS; the rest wait)."""
        pending = self.pending.pop(instance_id, [])
        if len(pending) > MAX_BATCH_ROWS:
            self.pending[instance_id] = pending[MAX_BATCH_ROWS:]
        return pending[:MAX_BATCH_ROWS]

    def restore(self, instance_id: str, request_ids: list[str]) -> None:
        """Releases whose batch got no answer go out again with the next one (receivers ignore
        unknown ids), unless the instance is gone."""
        if request_ids and self.placement.alive(instance_id):
            self.pending.setdefault(instance_id, [])[:0] = request_ids

    def forget(self, instance_id: str) -> None:
        """A dead instance's slots went with it."""
        self.pending.pop(instance_id, None)

    def live(self, role: str) -> set[str]:
        """Live instances of role with slots to release."""
        return {i for i in self.pending if self.placement.alive(i) and self.placement.is_role(i, role)}
