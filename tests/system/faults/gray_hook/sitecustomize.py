"""Test-only gray failure for the chaos harness (ops/faults/chaos.py): a verifier or drafter that goes on
heartbeating but never finishes a batch. Python imports `sitecustomize` at start-up from
sys.path, so this runs only in a process whose PYTHONPATH holds this directory, which the
harness gives the verifiers alone, together with SPECBUS_TEST_GRAY_DIR. Nothing shipped reads
either.

While the file `<SPECBUS_TEST_GRAY_DIR>/<instance id>` exists, every batch that arrives is taken
and never answered: the handler waits until the file is gone, then drops the batch without a
reply (the scheduler has given up on it by then). Heartbeats, stats and everything else go on
as usual. The handler is replaced on services.runtime.model_service before its serving loop
looks it up; the instance id comes from the command line (`--instance-id`), read when a batch
comes (sys.argv is not set yet while sitecustomize runs).
"""

import asyncio
import os
import sys
from pathlib import Path

GRAY_DIR = os.environ.get("SPECBUS_TEST_GRAY_DIR")
POLL_S = 0.05


def gray_file() -> Path:
    argv = sys.argv
    instance_id = argv[argv.index("--instance-id") + 1] if "--instance-id" in argv else "unknown"
    return Path(GRAY_DIR) / instance_id


if GRAY_DIR:
    import services.runtime.model_service

    honest_handle_batch = services.runtime.model_service.handle_batch

    async def gray_handle_batch(owner, service, metrics, nc, lock, msg) -> None:
        if not gray_file().exists():
            await honest_handle_batch(owner, service, metrics, nc, lock, msg)
            return
        owner.counters["gray_dropped"] += 1
        while gray_file().exists():
            await asyncio.sleep(POLL_S)

    services.runtime.model_service.handle_batch = gray_handle_batch
