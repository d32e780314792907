"""The drafter service: serves `<prefix>.draft.<instance_id>` with the drafter kind its config's
draft_method names (gpu_worker/drafter/registry.py `DRAFTERS`: "model", a draft model,
gpu_worker/drafter/drafter_core.py; "ngram", prompt lookup, no model, gpu_worker/drafter/ngram.py;
"eagle", an EAGLE head over the target's features, gpu_worker/drafter/eagle_drafter.py), every
kind's batches answered by drafter_core.py `draft_batch`.
"""

from __future__ import annotations

import asyncio

import structlog

from gpu_worker.drafter.drafter_core import draft_batch
from gpu_worker.drafter.registry import DRAFTERS
from schemas.config import DrafterConfig
from schemas.steps import DraftRequest
from schemas.bus.subjects import Subjects
from services.runtime.model_service import SlotService, on_model_thread, run_slot_service

log = structlog.get_logger(__name__)


async def run_drafter(config: DrafterConfig, stop: asyncio.Event) -> None:
    """Serve `<prefix>.draft.<instance_id>` until `stop` is set, then drain.

    services/runtime/model_service.py `run_slot_service` does the serving: nats.micro service "drafter"
    ($SRV.PING/INFO/STATS.drafter), heartbeats every heartbeat_interval_s with the kind's model_ids
    (its module's docstring says which), idle slot eviction, metrics on metrics_port.
    """
    subjects = Subjects(config.prefix)
    kind = DRAFTERS[config.draft_method]
    drafter = await on_model_thread(kind.load, config)
    if kind.warm is not None:
        await on_model_thread(kind.warm, drafter)
    log.info("drafter_loaded", instance_id=config.instance_id,
             **{key: getattr(config, setting) for key, setting in kind.logged}, max_slots=config.max_slots,
             **drafter.model_ids)
    await run_slot_service(drafter, config, SlotService(
        role="drafter", endpoint="draft", description=kind.description,
        subject=subjects.draft(config.instance_id), request_type=DraftRequest,
        run_batch=lambda request: (draft_batch(drafter, request), None)), stop)
