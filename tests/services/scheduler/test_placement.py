"""Placement (services/scheduler/placement.py) without NATS: the registry's liveness on an explicit
clock. Pinning by room is exercised through SchedulerState in test_scheduler_core.py."""

import pytest

from services.scheduler.placement import InstanceRegistry


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
