"""The drafter service: serves `<prefix>.draft.<instance_id>` with the draft logic of
gpu_worker/drafter_core.py (`load_drafter`, `draft_batch`: draft_method "model"), or of
gpu_worker/ngram.py (`load_ngram_drafter`, `ngram_draft_batch`: draft_method "ngram", prompt
lookup, no model).
"""

from __future__ import annotations

import asyncio

import structlog

from gpu_worker.drafter_core import draft_batch, load_drafter
from gpu_worker.ngram import load_ngram_drafter, ngram_draft_batch
from schemas.config import DrafterConfig
from schemas.messages import DraftRequest
from schemas.subjects import Subjects
from services.pipeline.model_service import SlotService, run_slot_service

log = structlog.get_logger(__name__)


async def run_drafter(config: DrafterConfig, stop: asyncio.Event) -> None:
    """Serve `<prefix>.draft.<instance_id>` until `stop` is set, then drain.

    services/pipeline/model_service.py `run_slot_service` does the serving: nats.micro service "drafter"
    ($SRV.PING/INFO/STATS.drafter), heartbeats every heartbeat_interval_s with model_ids
    ({"draft", "tokenizer", "target_vocab_size"} for a model; {"draft": "ngram", "draft_method":
    "ngram", "tokenizer": "any", "ngram"} for prompt lookup), idle slot eviction, metrics on metrics_port.
    """
    subjects = Subjects(config.prefix)
    if config.draft_method == "ngram":
        drafter = load_ngram_drafter(config)
        run_batch, description = ngram_draft_batch, "proposes draft tokens by prompt lookup (n-gram, no model)"
        log.info("drafter_loaded", instance_id=config.instance_id, max_slots=config.max_slots, **drafter.model_ids)
    else:
        drafter = await asyncio.to_thread(load_drafter, config)
        run_batch, description = draft_batch, "proposes draft tokens with the draft model"
        log.info("drafter_loaded", instance_id=config.instance_id, model=config.draft_model,
                 max_slots=config.max_slots, **drafter.model_ids)
    await run_slot_service(drafter, config, SlotService(
        role="drafter", endpoint="draft", description=description,
        subject=subjects.draft(config.instance_id), request_type=DraftRequest,
        run_batch=lambda request: (run_batch(drafter, request), None)), stop)
