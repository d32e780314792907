"""The KV cache memory budget through a real multi-process stack (tiny random models).

The verifier's --kv-cache-memory holds two requests' blocks at a time (one block of 512
positions of the tiny target is 513 x 320 bytes: its keys and values and its bf16 feature row;
the drafter's smaller model fits more in the same budget). Six requests at once: the verifier's
heartbeats never offer more than the memory admits, the scheduler keeps the rest queued until
memory is freed, and every request gives what it gives alone, or is refused `overloaded` by the
verifier (a heartbeat sent before a batch took the memory may reach the scheduler after it, so
a request can be pinned to a verifier whose memory just ran out; at least the first two run).
A prompt longer than the whole budget is refused `overloaded`, and nothing crashes: the same
processes serve the next request and the memory is free again afterwards.
"""

import asyncio
import time

import pytest
import pytest_asyncio
import torch

from schemas.bus.codec import decode
from schemas.bus.control import Heartbeat
from schemas.errors import ErrorCode
from services.client import Overloaded, make_request
from tests.tiny_checkpoints import VT

pytestmark = pytest.mark.asyncio(loop_scope="module")

# the tiny target: 2 layers x 2 KV heads x head dim 8, float32, keys and values (256 bytes a position)
# and the verifier's feature row, 32 bf16 values (64)
BLOCK_BYTES = 513 * (256 + 64)
BUDGET = 2 * BLOCK_BYTES + 40_000  # two blocks and the 10% admission headroom
TIMEOUT_S = 120.0  # per request: queued ones wait for memory
HANG_GUARD_S = 300.0  # a wait that would otherwise never end fails after this: a hang, not a speed bound
HEARTBEAT_S = "0.1"


def greedy(prompt, max_tokens=16):
    return make_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=4,
                        timeout_s=TIMEOUT_S)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, tiny_random_pair):
    beat = ["--heartbeat-interval-s", HEARTBEAT_S]
    role_args = {"scheduler": ["--draft-timeout-s", "5", *beat], "verifier": beat, "drafter": beat,
                 "postprocessor": beat}
    async with start_stack(*tiny_random_pair, kv_cache_memory=str(BUDGET), role_args=role_args) as running:
        yield running


async def test_requests_wait_for_memory_and_a_prompt_too_long_for_it_is_refused(stack):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VT, (12 + i,), generator=generator).tolist() for i in range(6)]
    beats: list[Heartbeat] = []

    async def on_beat(msg):
        beats.append(decode(msg.data, Heartbeat))

    subscription = await stack.nc.subscribe(stack.subjects.heartbeat, cb=on_beat)
    pids = {instance_id: p.process.pid for instance_id, p in stack.processes.items()}
    async with stack.client() as client:
        alone = [(await client.generate(greedy(p))).token_ids for p in prompts[:2]]
        reference = alone + [(await client.generate(greedy(p))).token_ids for p in prompts[2:]]
        together = await asyncio.wait_for(asyncio.gather(*(client.generate(greedy(p)) for p in prompts),
                                                         return_exceptions=True), timeout=2 * TIMEOUT_S)
        done = [i for i, r in enumerate(together) if not isinstance(r, Exception)]
        refused = [r for r in together if isinstance(r, Exception)]
        assert all(isinstance(r, Overloaded) and "KV cache memory budget" in r.message for r in refused), refused
        assert len(done) >= 2 and all(together[i].token_ids == reference[i] for i in done)
        print(f"\n{len(done)} of 6 ran, {len(refused)} refused overloaded")
        with pytest.raises(Overloaded, match="KV cache memory budget") as refused:
            await client.generate(greedy(torch.randint(1, VT, (1100,), generator=generator).tolist(), 4))
        assert refused.value.code == ErrorCode.overloaded
        assert (await client.generate(greedy(prompts[0]))).token_ids == alone[0]
        hang_guard = time.monotonic() + HANG_GUARD_S
        while not any(b.role == "verifier" and b.free_slots == 2 and b.load == 0 for b in beats[-4:]):
            assert time.monotonic() < hang_guard, f"verifier memory never freed (hang guard): {beats[-4:]}"
            await asyncio.sleep(0.1)
    await subscription.unsubscribe()
    verifier_beats = [b for b in beats if b.role == "verifier"]
    assert verifier_beats and max(b.free_slots for b in verifier_beats) == 2  # what two blocks admit
    assert {i: p.process.pid for i, p in stack.processes.items()} == pids  # no process restarted
