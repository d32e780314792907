"""The one wall clock: SPECBUS_CLOCK_OFFSET_S shifts it, a bad value names the variable."""

import subprocess
import sys
import time

import pytest

from schemas.bus import clock


def test_wall_follows_time_by_the_offset():
    before = time.time()
    now = clock.wall()
    assert before + clock.OFFSET_S <= now <= time.time() + clock.OFFSET_S


def test_the_offset_is_read_from_the_environment():
    assert clock.read_offset({}) == 0.0
    assert clock.read_offset({clock.CLOCK_OFFSET_ENV: "-7.5"}) == -7.5
    with pytest.raises(ValueError, match=clock.CLOCK_OFFSET_ENV):
        clock.read_offset({clock.CLOCK_OFFSET_ENV: "soon"})


def test_a_process_started_with_an_offset_is_that_far_ahead():
    """What the fault harness does to a service: its whole process runs on a shifted clock."""
    code = "import time; from schemas.bus.clock import wall; print(wall() - time.time())"
    out = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, clock.CLOCK_OFFSET_ENV: "8"},
                         capture_output=True, text=True, check=True, timeout=60)
    assert 7.9 < float(out.stdout) < 8.1
