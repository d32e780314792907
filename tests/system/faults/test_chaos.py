"""The fault harness (ops/faults/chaos.py) at a small size: a 3-node NATS cluster and every service in a
network namespace of its own, 16 concurrent streams of every workload kind (greedy, seeded
samples, logprobs, a regex grammar, prefix-cache hits, the gateway's OpenAI API), the services'
clocks seconds apart, and each fault of the nemesis but the rolling restart and upgrade once
(tests/system/faults/test_upgrade.py rolls an upgrade without namespaces), held HOLD_S. The checker (ops/faults/chaos_check.py) holds the history to docs/PROTOCOL.md#guarantees-under-faults,
with no typed error allowed either: every admitted request identical to its fault-free run.
`make chaos` runs the same for as long as asked, the rolling restart and upgrade included.

Needs root (network namespaces, veth pairs, routes, tc); skipped elsewhere, with the reason.
"""

import os

import pytest

from ops.faults import netns
from ops.faults.chaos import FAULTS, chaos

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

STREAMS = 16
HOLD_S = 2.5


def cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    return netns.available()


@pytest.mark.skipif(cannot_run() is not None, reason=str(cannot_run()))
async def test_every_fault_under_load_changes_no_output(tiny_pair, tmp_path):
    faults = [name for name in FAULTS if not name.startswith("rolling-")]
    verdict = await chaos(STREAMS, specs=STREAMS, max_tokens=32, faults=faults, hold_s=HOLD_S, every_s=0.5,
                          duration_s=0, out=tmp_path, target=str(tiny_pair[0]), draft=str(tiny_pair[1]))
    print(f"\noutcomes {dict(verdict.counts)}")
    for fault in verdict.recoveries:
        print(fault)
    assert verdict.ok, verdict.problems[:10]
    assert [fault["fault"] for fault in verdict.recoveries] == faults
    assert all(fault["recover_s"] is not None for fault in verdict.recoveries if fault["in_flight"])
    assert sum(count for outcome, count in verdict.counts.items() if outcome.startswith("identical")) >= STREAMS
