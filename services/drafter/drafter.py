"""The drafter service: serves `<prefix>.draft.<instance_id>` with the draft logic of
gpu_worker/drafter/drafter_core.py (`load_drafter`, `draft_batch`: draft_method "model"), of
gpu_worker/drafter/ngram.py (`load_ngram_drafter`, `ngram_draft_batch`: draft_method "ngram", prompt
lookup, no model) or of gpu_worker/drafter/eagle_drafter.py (`load_eagle_drafter`, `eagle_draft_batch`:
draft_method "eagle", an EAGLE head over the target's features).
"""

from __future__ import annotations

import asyncio

import structlog

from gpu_worker.drafter.drafter_core import draft_batch, load_drafter
from gpu_worker.drafter.eagle_drafter import eagle_draft_batch, load_eagle_drafter
from gpu_worker.batching.grammar_masks import warm_grammars
from gpu_worker.drafter.ngram import load_ngram_drafter, ngram_draft_batch
from schemas.config import DrafterConfig
from schemas.steps import DraftRequest
from schemas.bus.subjects import Subjects
from services.runtime.model_service import SlotService, on_model_thread, run_slot_service

log = structlog.get_logger(__name__)


async def run_drafter(config: DrafterConfig, stop: asyncio.Event) -> None:
    """Serve `<prefix>.draft.<instance_id>` until `stop` is set, then drain.

    services/runtime/model_service.py `run_slot_service` does the serving: nats.micro service "drafter"
    ($SRV.PING/INFO/STATS.drafter), heartbeats every heartbeat_interval_s with model_ids
    ({"draft", "tokenizer", "target_vocab_size"} for a model; {"draft": "ngram", "draft_method":
    "ngram", "tokenizer": "any", "ngram"} for prompt lookup; {"draft", "draft_method": "eagle",
    "tokenizer", "target", "hidden_size", "target_vocab_size"} for an EAGLE head), idle slot
    eviction, metrics on metrics_port.
    """
    subjects = Subjects(config.prefix)
    if config.draft_method == "ngram":
        drafter = load_ngram_drafter(config)
        run_batch, description = ngram_draft_batch, "proposes draft tokens by prompt lookup (n-gram, no model)"
        log.info("drafter_loaded", instance_id=config.instance_id, max_slots=config.max_slots, **drafter.model_ids)
    elif config.draft_method == "eagle":
        drafter = await on_model_thread(load_eagle_drafter, config)
        run_batch = eagle_draft_batch
        description = "proposes draft tokens with an EAGLE head over the target's features"
        log.info("drafter_loaded", instance_id=config.instance_id, head=config.eagle_head,
                 target_model=config.target_model, max_slots=config.max_slots, **drafter.model_ids)
    else:
        drafter = await on_model_thread(load_drafter, config)
        await on_model_thread(warm_grammars, drafter, drafter.target_vocab_size)
        run_batch, description = draft_batch, "proposes draft tokens with the draft model"
        log.info("drafter_loaded", instance_id=config.instance_id, model=config.draft_model,
                 max_slots=config.max_slots, **drafter.model_ids)
    await run_slot_service(drafter, config, SlotService(
        role="drafter", endpoint="draft", description=description,
        subject=subjects.draft(config.instance_id), request_type=DraftRequest,
        run_batch=lambda request: (run_batch(drafter, request), None)), stop)
