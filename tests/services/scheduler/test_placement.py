"""Placement (services/scheduler/placement.py) without NATS: the registry's liveness on an explicit
clock. Pinning by room is exercised through SchedulerState in test_scheduler_core.py."""

import pytest

from schemas.bus.control import Heartbeat
from schemas.bus.protocol import PROTOCOL_VERSION
from schemas.bus.versions import Window
from services.scheduler.placement import InstanceRegistry, Placement


def test_registry_with_explicit_clock():
    registry = InstanceRegistry(timeout_s=1.0)
    assert registry.observe("a", {"load": 0}, role="drafter", now=10.0) is True
    assert registry.observe("a", {"load": 1}, role="drafter", now=10.5) is False
    assert registry.alive(now=11.5)[0].info == {"load": 1}
    assert registry.reap(now=11.5) == []
    assert [i.instance_id for i in registry.reap(now=11.6)] == ["a"]
    assert registry.reap(now=12.0) == []  # reported once
    assert registry.observe("a", {"load": 0}, role="drafter", now=13.0) is True  # back as new
    with pytest.raises(ValueError, match="timeout_s"):
        InstanceRegistry(timeout_s=0)


def test_instances_whose_version_window_overlaps_are_placed_and_addressed_in_the_highest_both_speak():
    n = PROTOCOL_VERSION
    clock = [100.0]
    placement = Placement(3.0, "tok", monotonic=lambda: clock[0], window=Window(n, n + 1))

    def beat(instance_id: str, low: int, high: int) -> Heartbeat:
        return Heartbeat(instance_id=instance_id, role="verifier", capacity=4, load=0, protocol_min=low,
                         protocol_version=high, model_ids={"tokenizer": "tok"}, sent_at=1.0, interval_s=1.0)

    for heartbeat in (beat("old", n, n), beat("both", n, n + 1), beat("new", n + 1, n + 1),
                      beat("past", n - 1, n - 1)):
        placement.observe(heartbeat)
    assert [i.instance_id for i in placement.compatible("verifier")] == ["both", "new", "old"]
    assert "protocol versions" in placement.misfit(beat("past", n - 1, n - 1))
    assert placement.version_toward("old") == n and placement.version_toward("both") == n + 1
    assert placement.version_toward("both", "old") == n  # a batch whose side records reach an old one
    assert placement.version_toward("new", cap=n) == n  # a commit for a client that reads n
    assert placement.version_toward("unheard-of") == n
