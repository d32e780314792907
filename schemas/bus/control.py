"""The control plane: the Heartbeat every instance publishes (docs/PROTOCOL.md#heartbeats-and-liveness)."""

from typing import Literal

from pydantic import Field

from schemas.bus.versions import WINDOW
from schemas.bus.wire import Count, InstanceId, Message


class Heartbeat(Message):
    """every instance -> schedulers, every interval_s; silence for a few intervals = dead."""

    type: Literal["heartbeat"] = "heartbeat"
    instance_id: InstanceId
    role: Literal["scheduler", "drafter", "verifier", "postprocessor"]
    capacity: Count  # rows or slots it can hold
    load: Count  # in flight now
    free_slots: int | None = Field(None, ge=0)
    # e.g. {"target": "...", "draft": "...", "tokenizer": hash}; a drafter's "draft_method" ("model"
    # when absent, "ngram" or "eagle"); "tokenizer": ANY_TOKENIZER for an instance that fits every target
    model_ids: dict[str, str] = Field(default_factory=dict)
    # the sender's version window [protocol_min, protocol_version] (schemas/bus/versions.py); a beat goes
    # out once per version of it, and each receiver keeps the copy addressed to it (Window.keeps)
    protocol_version: int = WINDOW.high
    protocol_min: int = WINDOW.low
    sent_at: float = Field(ge=0, allow_inf_nan=False)
    interval_s: float = Field(gt=0, allow_inf_nan=False)
