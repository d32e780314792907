"""The wall clock: the one place every process takes wall-clock time from (`wall()`), for the
absolute deadlines on the wire and the `sent_at` of heartbeats. Intervals and liveness use
`time.monotonic()`, which no skew touches.

Machines' clocks disagree. A deadline is set on its sender's clock and read on its receiver's,
so a receiver whose clock is ahead sees it as passed sooner. The rule (docs/PROTOCOL.md#deadlines):
a process refuses work for a deadline another process set only once that deadline is more than
MAX_CLOCK_SKEW_S past on its own clock (`bus.expired(..., skew_s=MAX_CLOCK_SKEW_S)`), so clocks
up to MAX_CLOCK_SKEW_S apart never refuse work the sender still waits for; deadlines a process
set itself (a request's, the scheduler's waits) are read on the clock that set them.

SPECBUS_CLOCK_OFFSET_S (seconds, may be negative; default 0) shifts this process's wall clock:
how the fault harness (ops/faults/chaos.py) gives each service a skewed machine.
"""

import os
import time

CLOCK_OFFSET_ENV = "SPECBUS_CLOCK_OFFSET_S"
MAX_CLOCK_SKEW_S = 10.0  # how far apart two processes' wall clocks may be


def read_offset(env: dict[str, str] | os._Environ = os.environ) -> float:
    raw = env.get(CLOCK_OFFSET_ENV, "0") or "0"
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{CLOCK_OFFSET_ENV}: expected seconds, got {raw!r}") from None


OFFSET_S = read_offset()


def wall() -> float:
    """Seconds since the epoch on this process's (possibly shifted) wall clock."""
    return time.time() + OFFSET_S
