"""What a client reads on its inbox: StreamChunks with their per-token logprobs, sampling
masks and the final Usage, and Admitted (docs/PROTOCOL.md#client-and-scheduler).
"""

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from schemas.arrays import LogprobVector, TokenIds, empty_ids, empty_logprobs
from schemas.bus.protocol import MAX_TREE_NODES
from schemas.bus.wire import (Count, DegradedReason, Error, FinishReason, InstanceId, Logprob, Message, RequestId,
                          WireModel, field_error)


class SamplingMask(WireModel):
    """The candidate set K a token was sampled from.

    all_tokens=True: K is the whole vocabulary (no filter cut anything); token_ids is empty.
    Otherwise token_ids are K's ids, sorted ascending; `size` is |K|, and size > len(token_ids)
    means the mask was truncated to max_mask_size ids.
    """

    token_ids: TokenIds = Field(default_factory=empty_ids)
    size: Count = 0
    all_tokens: bool = False

    @property
    def truncated(self) -> bool:
        return not self.all_tokens and self.size > len(self.token_ids)

    @model_validator(mode="after")
    def _consistent(self) -> "SamplingMask":
        if self.all_tokens and len(self.token_ids):
            raise field_error("token_ids", "a mask of all tokens carries no ids")
        if len(self.token_ids) > self.size:
            raise field_error("size", f"size {self.size} is below the {len(self.token_ids)} ids given")
        if len(self.token_ids) > 1 and not (np.diff(self.token_ids) > 0).all():
            raise field_error("token_ids", "mask ids must be sorted ascending without repeats")
        return self


class TokenLogprob(WireModel):
    """Logprob data for one token, as the client reads it.

    top_ids/top_logprobs are parallel arrays, most likely first (`top` pairs them up);
    requested_logprobs follow the order of the request's logprob_token_ids.
    """

    token_id: Count
    logprob: Logprob
    rank: int | None = Field(None, ge=1)  # 1 = most likely
    token: str | None = None  # decoded text of this token, when the postprocessor has it
    top_ids: TokenIds = Field(default_factory=empty_ids)
    top_logprobs: LogprobVector = Field(default_factory=empty_logprobs)
    requested_logprobs: LogprobVector = Field(default_factory=empty_logprobs)

    @property
    def top(self) -> list[tuple[int, float]]:
        return list(zip(self.top_ids.tolist(), self.top_logprobs.tolist()))

    @model_validator(mode="after")
    def _parallel(self) -> "TokenLogprob":
        if self.top_ids.shape != self.top_logprobs.shape:
            raise field_error("top_logprobs", f"{len(self.top_logprobs)} top logprobs for {len(self.top_ids)} top ids")
        return self


class Usage(WireModel):
    prompt_tokens: Count = 0
    cached_tokens: Count = Field(0, description="prompt tokens the verifiers took from their prefix caches "
                                                "instead of computing them (OpenAI's prompt_tokens_details)")
    completion_tokens: Count = 0
    draft_tokens_proposed: Count = Field(0, description="draft tokens sent to verification: every node of a tree")
    draft_tokens_accepted: Count = 0
    acceptance_rate: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    steps: Count = 0
    degraded_steps: dict[DegradedReason, Count] = Field(default_factory=dict)
    speculative_lengths: list[Count] = Field(
        default_factory=list, max_length=MAX_TREE_NODES + 1,
        description="[k]: decode steps that verified k draft tokens, the nodes of a tree (the scheduler picks k per "
                    "step up to num_speculative_tokens; a step degraded to no drafts counts at 0)")


class StreamChunk(Message):
    """postprocessor -> client inbox, seq 0, 1, 2, ... per request with no gaps.

    token_ids, text (a delta), from_draft (True for an accepted draft token), logprobs and
    sampling_masks are per token and the same length. The final chunk has finish_reason
    and usage. The first chunk carries prompt_token_ids / prompt_logprobs when asked
    (prompt_logprobs[0] is None: the first prompt token has no context). scheduler_id: the
    scheduler that owns the request (the client watches its heartbeats to fail over).
    """

    type: Literal["stream_chunk"] = "stream_chunk"
    request_id: RequestId
    seq: Count
    token_ids: TokenIds = Field(default_factory=empty_ids)
    text: str = ""
    from_draft: list[bool] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    sampling_masks: list[SamplingMask] | None = None
    degraded: list[DegradedReason] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    prompt_token_ids: TokenIds | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: Error | None = None
    scheduler_id: InstanceId | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    @model_validator(mode="after")
    def _per_token_lengths(self) -> "StreamChunk":
        num_tokens = len(self.token_ids)
        for name in ("from_draft", "logprobs", "sampling_masks"):
            values = getattr(self, name)
            if values is not None and len(values) != num_tokens:
                raise field_error(name, f"{len(values)} entries for {num_tokens} tokens")
        if self.prompt_logprobs is not None and self.prompt_token_ids is not None \
                and len(self.prompt_logprobs) != len(self.prompt_token_ids):
            raise field_error("prompt_logprobs",
                              f"{len(self.prompt_logprobs)} entries for {len(self.prompt_token_ids)} prompt tokens")
        return self


class Admitted(Message):
    """scheduler -> client inbox, beside the StreamChunks (not one of them: no seq): the
    request reached scheduler `scheduler_id` and waits in its queue (`started` False, sent on
    admission), or it has started running (`started` True). A client that hears neither this
    nor a chunk within its admission_timeout_s sends the request again (the GenerateRequest or
    this answer was lost, e.g. in a dying NATS node); once the request started, a silence
    longer than idle_timeout_s means its output was lost (docs/PROTOCOL.md#scheduler-failover).
    """

    type: Literal["admitted"] = "admitted"
    request_id: RequestId
    scheduler_id: InstanceId
    started: bool = False
