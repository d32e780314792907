"""What reaches the postprocessor and what it answers: the scheduler's Commits, the verifier's
SideChannelRecords with their LogprobArrays, and the StopNotice back to the owning scheduler
(docs/PROTOCOL.md#to-the-postprocessor, #back-to-the-scheduler).
"""

from typing import Literal

from pydantic import Field, model_validator

from schemas.arrays import IdMatrix, LogprobMatrix, LogprobVector, Ranks, TokenIds, empty_ids
from schemas.generation import LogprobOptions
from schemas.bus.protocol import MAX_INBOX_LEN, MAX_STOP_STRINGS, MAX_TREE_NODES
from schemas.steps import check_accepted
from schemas.streams import SamplingMask, Usage
from schemas.bus.wire import (Count, DegradedReason, Error, FinishReason, InstanceId, LogprobsMode, Message, RequestId,
                          StopString, WireModel, field_error)


class LogprobArrays(WireModel):
    """Logprob statistics for n positions, computed on the GPU side (docs/PROTOCOL.md#logprobarrays).

    token_logprobs [n]: the logprob of the token at each position.
    top_ids / top_logprobs [n, N]: top-N, most likely first (-1 id = padding, -inf logprob).
    requested_logprobs [n, R]: logprobs of the request's logprob_token_ids.
    ranks [n]: rank of the token (1 = most likely), when computed.
    logz_k [n]: log of the mass of the candidate set K under the temperature-scaled softmax.

    mode "raw": values are log_softmax(logits). mode "processed": values are
    log_softmax(logits / T), and the processed logprob of an id in K is value - logz_k
    (-inf outside K). For greedy rows K = {argmax}: logz_k is the argmax's value.
    """

    token_logprobs: LogprobVector
    top_ids: IdMatrix
    top_logprobs: LogprobMatrix
    requested_logprobs: LogprobMatrix
    ranks: Ranks | None = None
    logz_k: LogprobVector | None = None

    @property
    def n(self) -> int:
        return len(self.token_logprobs)

    @model_validator(mode="after")
    def _shapes(self) -> "LogprobArrays":
        n = self.n
        if self.top_ids.shape[0] != n or self.top_ids.shape != self.top_logprobs.shape:
            raise field_error("top_logprobs", f"top_ids {list(self.top_ids.shape)} and top_logprobs "
                              f"{list(self.top_logprobs.shape)} must both be [{n}, N]")
        for name in ("requested_logprobs", "ranks", "logz_k"):
            value = getattr(self, name)
            if value is not None and value.shape[0] != n:
                raise field_error(name, f"{value.shape[0]} rows for {n} positions")
        return self


class SideChannelRecord(Message):
    """verifier -> postprocessor, one per (request_id, batch_id) when the request asked for
    logprobs or masks. logprobs and masks cover token_ids (the emitted tokens);
    prompt_logprobs covers prompt positions prompt_offset, prompt_offset+1, ...
    (a position's logprob is that of the prompt token there given the tokens before it).
    """

    type: Literal["side_channel"] = "side_channel"
    request_id: RequestId
    batch_id: Count
    step: Count
    verifier_id: InstanceId
    mode: LogprobsMode = "raw"
    token_ids: TokenIds = Field(default_factory=empty_ids)
    logprobs: LogprobArrays | None = None
    masks: list[SamplingMask] | None = None
    prompt_logprobs: LogprobArrays | None = None
    prompt_offset: Count = 0

    @model_validator(mode="after")
    def _covers_tokens(self) -> "SideChannelRecord":
        num_tokens = len(self.token_ids)
        if self.logprobs is not None and self.logprobs.n != num_tokens:
            raise field_error("logprobs.token_logprobs", f"{self.logprobs.n} positions for {num_tokens} tokens")
        if self.masks is not None and len(self.masks) != num_tokens:
            raise field_error("masks", f"{len(self.masks)} masks for {num_tokens} tokens")
        if self.mode == "processed":
            for name in ("logprobs", "prompt_logprobs"):
                arrays = getattr(self, name)
                if arrays is not None and arrays.logz_k is None:
                    raise field_error(f"{name}.logz_k", "processed mode needs logz_k")
        return self


class Commit(Message):
    """scheduler -> postprocessor: tokens committed for a request at one step.

    seq is the seq of the StreamChunk this commit becomes (the scheduler numbers commits, so a
    replacement postprocessor continues the sequence). token_ids may be shorter than what the
    verifier emitted (cut at max_tokens / a stop token): the first len(token_ids) side-channel
    entries apply, and the first num_accepted of them came from the draft.
    First commit: prompt_token_ids. Final commit: finish_reason and usage.
    resume_token_ids: the completion tokens committed before this one, sent when the request
    moves to a new postprocessor so it can rebuild its detokenizer state.
    error: on a final commit with finish_reason "error", why (passed on in the final chunk).
    """

    type: Literal["commit"] = "commit"
    request_id: RequestId
    batch_id: Count
    step: Count
    seq: Count
    scheduler_id: InstanceId
    client_inbox: str = Field(min_length=1, max_length=MAX_INBOX_LEN)
    token_ids: TokenIds = Field(default_factory=empty_ids)
    num_draft: int = Field(0, ge=0, le=MAX_TREE_NODES, description=(
        "the step's draft tokens (VerifyResult.num_draft): every node of a tree"))
    num_accepted: Count = 0
    finish_reason: FinishReason | None = None
    degraded: list[DegradedReason] = Field(default_factory=list)
    expect_side_channel: bool = False
    usage: Usage | None = None
    prompt_token_ids: TokenIds | None = None
    logprobs: LogprobOptions = Field(default_factory=LogprobOptions)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stream: bool = True
    resume_token_ids: TokenIds | None = None
    error: Error | None = None

    @model_validator(mode="after")
    def _counts(self) -> "Commit":
        check_accepted(self.num_draft, self.num_accepted)
        return self


class StopNotice(Message):
    """postprocessor -> the owning scheduler: stop this request.

    reason "stop": a stop string matched; the text ends at character text_offset of the
    completion, within its first num_tokens tokens. reason "error": the postprocessor cannot
    go on (e.g. the client inbox has no responders)."""

    type: Literal["stop_notice"] = "stop_notice"
    request_id: RequestId
    batch_id: Count
    step: Count
    postprocessor_id: InstanceId
    reason: Literal["stop", "error"] = "stop"
    stop: str | None = None
    text_offset: Count = 0
    num_tokens: Count = 0
