"""The drafter's and verifier's shared shell (services/runtime/model_service.py) without NATS:
idle eviction while no batches arrive."""

import asyncio
import time

from services.runtime.model_service import evict_idle_loop
from tests.slot_owner import MAX_SLOTS, take


async def test_evict_idle_loop_gives_capacity_back_without_batches(owner):
    owner.slot_idle_ttl_s = 0.05
    take(owner, "a", time.monotonic())
    task = asyncio.create_task(evict_idle_loop(owner, asyncio.Lock()))
    try:
        deadline = time.monotonic() + 5.0
        while owner.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
    assert not owner.requests and owner.cache.num_free == MAX_SLOTS
