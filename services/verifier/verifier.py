"""The verifier service: serves `<prefix>.verify.<instance_id>` with the step logic of
gpu_worker/verifier/verifier_core.py, and publishes side-channel records to `<prefix>.post.<id>.side`.

`run_verifier(config, stop)` (started by `specbus serve verifier`): loads the target and serves
it with services/runtime/model_service.py `run_slot_service`: nats.micro service "verifier"
($SRV.PING/INFO/STATS.verifier), heartbeats (role verifier, capacity = max_slots, free_slots,
load = slots in use, model_ids {"target", "tokenizer"}), idle slot eviction, metrics on
metrics_port, one batch at a time on the model thread; once a VerifyResponse is sent, the batch's
side records are published. Once loaded it logs which path each op runs (`kernel_paths`).

`python -m services.verifier.verifier kernel-paths [--target-model DIR --dtype D --weights W --json]`
prints that report for a verifier's settings (flags, else SPECBUS_* as `specbus serve verifier`
reads them) without serving: `specbus up` runs it and prints its lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import structlog
from nats.aio.client import Client

from gpu_worker.batching.grammar_masks import warm_grammars
from gpu_worker.batching.slots import instance_heartbeat, kernel_report
from gpu_worker.runtime import kernel_paths
from gpu_worker.verifier.verifier_core import SideRecord, Verifier, load_verifier, verify_batch
from schemas.bus.codec import encode
from schemas.config import VerifierConfig, load_config
from schemas.bus.control import Heartbeat
from schemas.steps import VerifyRequest
from schemas.bus.subjects import Subjects
from services.runtime.model_service import SlotService, on_model_thread, run_slot_service
from services.runtime.bus import BusError, publish

log = structlog.get_logger(__name__)


def heartbeat(verifier: Verifier, interval_s: float) -> Heartbeat:
    return instance_heartbeat(verifier, "verifier", interval_s)


async def publish_side_records(verifier: Verifier, subjects: Subjects, nc: Client, records: list[SideRecord],
                               v: int) -> None:
    """Publish a batch's side records once its reply is out (off the scheduler's critical path), in
    the batch's version v: the scheduler sends it in one every postprocessor speaks."""
    for postprocessor_id, record in records:
        try:
            await publish(nc, subjects.post_side(postprocessor_id), encode(record, v))
        except BusError as exc:
            verifier.counters["side_records_dropped"] += 1
            log.warning("side_record_dropped", request_id=record.request_id, error=str(exc))
        else:
            verifier.counters["side_records_published"] += 1


async def run_verifier(config: VerifierConfig, stop: asyncio.Event) -> None:
    """Serve `<prefix>.verify.<instance_id>` until `stop` is set, then drain."""
    verifier = await on_model_thread(load_verifier, config)
    await on_model_thread(warm_grammars, verifier, verifier.vocab_size)
    subjects = Subjects(config.prefix)
    log.info("verifier_loaded", instance_id=config.instance_id, model=config.target_model, device=config.device,
             dtype=config.dtype, max_slots=config.max_slots, **verifier.model_ids)
    paths = kernel_paths.report(config.device.split(":")[0], str(verifier.model.embed.dtype).removeprefix("torch."),
                                verifier.weights, verifier.model.config.head_dim)
    log.info("kernel_paths", **paths.as_dict())  # which path each op runs here (`specbus up` prints it)

    async def after_reply(nc: Client, records: list[SideRecord], v: int) -> None:
        await publish_side_records(verifier, subjects, nc, records, v)

    await run_slot_service(verifier, config, SlotService(
        role="verifier", endpoint="verify", description="verifies draft tokens with the target model",
        subject=subjects.verify(config.instance_id), request_type=VerifyRequest,
        run_batch=lambda request: verify_batch(verifier, request), after_reply=after_reply), stop)


def main(argv: list[str] | None = None) -> int:
    """`kernel-paths`: print the kernel report of a verifier's settings (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m services.verifier.verifier")
    command = parser.add_subparsers(dest="command", required=True).add_parser("kernel-paths")
    for name in ("target-model", "dtype", "weights", "device"):
        command.add_argument(f"--{name}", default=None)
    command.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    config = load_config(VerifierConfig, target_model=args.target_model, dtype=args.dtype, weights=args.weights,
                         device=args.device)
    report = kernel_report(config, config.target_model)
    print(json.dumps(report.as_dict()) if args.json else "\n".join(report.lines()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
