"""Every message on the bus (docs/PROTOCOL.md#messages) as a pydantic v2 model.

Each top-level message carries `v` (protocol version) and a `type` string; sub-models
(SamplingParams, Proposal, ...) carry neither. Token ids and probability/logprob vectors are
packed numpy arrays (schemas/arrays.py). Rows are always keyed by `request_id`, never by position.

A check that involves several fields raises `field_error(path, message)`: the codec appends
`path` to the error's location, so the client sees e.g. `rows[2].proposal.probs`.
"""

import hashlib
import math
import re
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from schemas.arrays import (IdMatrix, LogprobMatrix, LogprobVector, Packed, ProbMatrix, Ranks, TokenIds, empty_ids,
                            empty_logprobs, same_value)
from schemas.errors import ErrorCode, SpecbusError
from schemas.subjects import INSTANCE_ID_PATTERN

PROTOCOL_VERSION = 1
MAX_TOKENS_CAP = 4096  # default cap on max_tokens; a scheduler passes its own via decode(context=...)
MAX_TOP_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 64
MAX_SPECULATIVE_TOKENS = 16
# Heartbeat.model_ids["tokenizer"] of an instance with no vocabulary of its own (the ngram drafter):
# it fits every target.
ANY_TOKENIZER = "any"
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_MASK_SIZE = 1 << 20
MAX_BATCH_ROWS = 1024
MAX_PROMPT_CHARS = 1 << 20
MAX_CHAT_MESSAGES = 1024
MAX_TIMEOUT_S = 3600.0
MIN_TEMPERATURE = 0.01  # logits / 0.01 stay finite in float32 for any finite bf16/fp32 logit below ~3e36
MAX_TEMPERATURE = 100.0  # flatter than this is uniform to float32 precision for any real model
MIN_TOP_P = 1e-6  # a normal float32; top_p below the top token's probability keeps that token alone
MAX_TOP_K = 1 << 20  # above any vocabulary; top_k >= vocab size is "off"
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI allows
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| at most, as OpenAI: -100 bans a token in practice, +100 forces it
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty| at most, as OpenAI
MIN_REPETITION_PENALTY = 0.01  # logits / 0.01 stay finite in float32, as for MIN_TEMPERATURE
MAX_REPETITION_PENALTY = 100.0  # logits * 100 stay finite in float32 for any finite bf16/fp32 logit below ~3e36
MAX_INBOX_LEN = 256  # characters of a client's reply subject (Commit.client_inbox)
# Ids of a sampled draft's sparse proposal, at most, per draft position: a drafter samples from
# its top MAX_DRAFT_SUPPORT ids (renormalised), and schedulers size draft batches by it.
MAX_DRAFT_SUPPORT = 256

MAX_FEATURE_SIZE = 1 << 16  # values per position of a FeatureBlock (the target's hidden size) at most
# bytes of one FeatureBlock's data at most: a row's share of a message; larger goes in pieces
MAX_FEATURE_BLOCK_BYTES = 4 << 20

# Reasons a chunk can be flagged with; `degraded` accepts any snake_case word so a new
# fallback does not need a protocol bump, but these are the ones the pipeline emits.
DEGRADED_REASONS = ("draft_timeout", "logprobs_timeout", "logprobs_invalid", "migrated", "verifier_retry",
                    "residual_fallback", "resync", "failover")

RequestId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
InstanceId = Annotated[str, StringConstraints(pattern=INSTANCE_ID_PATTERN)]
Count = Annotated[int, Field(ge=0)]
Deadline = Annotated[float, Field(gt=0, allow_inf_nan=False)]  # absolute time.time() seconds
DegradedReason = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]
FinishReason = Literal["length", "stop", "eos", "cancelled", "timeout", "error"]
LogprobsMode = Literal["raw", "processed"]


def field_error(path: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_field", message, {"field": path})


def _finite_or_neg_inf(value: float) -> float:
    if math.isnan(value) or value == math.inf:
        raise ValueError("a logprob must not be NaN or +inf")
    return value


Logprob = Annotated[float, AfterValidator(_finite_or_neg_inf)]
BiasVector = Annotated[np.ndarray, Packed(("float32",), ndim=1)]  # finite, in [-100, 100]: checked by LogitBias


def new_request_id() -> str:
    return uuid.uuid4().hex


def seed_from_request_id(request_id: str) -> int:
    """A stable seed for a sampled request that gave none (0..2**63-1): the same id always draws
    the same tokens, whichever scheduler, verifier or drafter computes it."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little") & (2**63 - 1)


class WireModel(BaseModel):
    """Base of every model: strict fields, and equality that compares arrays by value."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(same_value(getattr(self, name), getattr(other, name)) for name in type(self).model_fields)

    __hash__ = None


class Message(WireModel):
    v: int = PROTOCOL_VERSION

    @field_validator("v")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != PROTOCOL_VERSION:
            raise PydanticCustomError("unsupported_version",
                                      "protocol version {v} not supported (this side speaks {ours})",
                                      {"v": v, "ours": PROTOCOL_VERSION})
        return v


# ---------------------------------------------------------------- request options


class LogitBias(WireModel):
    """OpenAI's logit_bias in packed form.

    token_ids / bias [n]: bias[i] is added to the logit of token_ids[i], before the penalties
    and the temperature. At most MAX_LOGIT_BIAS ids, each once; every bias finite and within
    +-MAX_LOGIT_BIAS_VALUE. The verifier checks the ids against its vocabulary (a row with an id
    outside it fails naming `sampling.logit_bias`).
    """

    token_ids: TokenIds
    bias: BiasVector

    @model_validator(mode="after")
    def _consistent(self) -> "LogitBias":
        n = len(self.token_ids)
        if len(self.bias) != n:
            raise ValueError(f"{n} token ids for {len(self.bias)} bias values")
        if n > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} token ids, got {n}")
        if len(np.unique(self.token_ids)) != n:
            raise ValueError("a token id appears twice")
        if not (np.abs(self.bias) <= MAX_LOGIT_BIAS_VALUE).all():  # False for NaN too
            raise ValueError(f"every bias must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}]")
        return self

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.token_ids.tolist(), self.bias.tolist()))


def logit_bias_from_mapping(value: Mapping) -> dict[str, list] | None:
    """OpenAI's {token id: bias} (ids as ints or decimal strings, as JSON has them) -> the fields
    of LogitBias; None for an empty map. ValueError naming the first bad entry."""
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} token ids, got {len(value)}")
    token_ids, bias = [], []
    for key, number in value.items():
        text = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
        if not isinstance(text, str) or not re.fullmatch(r"[0-9]{1,10}", text) or int(text) >= 2**31:
            raise ValueError(f"{key!r} is not a token id")
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"the bias of token {text} is not a number")
        token_ids.append(int(text))
        bias.append(float(number))
    return {"token_ids": token_ids, "bias": bias} if token_ids else None


class RowSampling(WireModel):
    """What a drafter and a verifier need to draw one row's tokens.

    temperature 0 means greedy (argmax; the filters are then irrelevant). top_k 0 = off,
    top_p 1 = off, min_p 0 = off. `seed`: a sampled row must carry one (GenerateRequest fills
    it from the request id when the client gave none), so a retried or migrated step draws the
    same tokens.

    Ranges (the kernels compute in float32, so every accepted value must mean the same there as
    here; the scheduler, the drafter and the verifier then agree on greedy vs sampled):
    temperature 0 or in [MIN_TEMPERATURE, MAX_TEMPERATURE] (1e-300 would be 0 in float32, i.e.
    greedy there but sampled here; 1e308 would be inf); top_p in [MIN_TOP_P, 1] (any top_p at
    or below the top token's probability keeps that token alone, so nothing is lost); top_k in
    [0, MAX_TOP_K]; min_p in [0, 1).

    logit_bias and the penalties (gpu_worker/sampling/sampler.py `penalise`, in vLLM's order: logit_bias,
    then repetition, frequency and presence penalties, then temperature and the filters) make a
    position's distribution depend on the tokens before it: frequency_penalty and
    presence_penalty count the output (the history after prompt_len, drafts of the same step
    included), repetition_penalty looks at the prompt and the output. All off by default.
    """

    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False,
                               description=f"0 = greedy, else in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description=f"0 = off, at most {MAX_TOP_K}")
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1, allow_inf_nan=False,
                         description=f"in [{MIN_TOP_P}, 1]; 1 = off")
    min_p: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False, description="in [0, 1); 0 = off")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False,
                                    description=f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], subtracted from the logit of "
                                                "every token the output holds; 0 = off")
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False,
                                     description=f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], times the token's count in "
                                                 "the output, subtracted from its logit; 0 = off")
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, allow_inf_nan=False,
                                      description="the logit of a token the prompt or the output holds is divided by "
                                                  "it (multiplied when negative); 1 = off")
    logit_bias: LogitBias | None = Field(None, description="added to the logits of its ids; None = none. A client may "
                                                           "give OpenAI's {token id: bias} map")
    coupling: Literal["rejection", "gumbel"] = Field(
        "rejection", description="how a sampled row's drafts are accepted: rejection sampling, or Gumbel-max "
                                 "coupling, whose output depends on (seed, prompt, sampling) only, not on k or the "
                                 "draft (docs/PROTOCOL.md#drafter-invariant-sampling); greedy rows ignore it")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _openai_logit_bias(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and set(value) != {"token_ids", "bias"}:
            return logit_bias_from_mapping(value)
        return value

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sane(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                             f"got {value}")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def gumbel(self) -> bool:
        """A sampled row drawn by Gumbel-max coupling (gpu_worker/sampling/coupling.py)."""
        return self.coupling == "gumbel" and not self.greedy

    @property
    def penalised(self) -> bool:
        """logit_bias or a penalty is on: a position's logits are more than the model's."""
        return (self.logit_bias is not None or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """Its packed arrays (the logit bias), for a sender that sizes a batch by them."""
        return () if self.logit_bias is None else (self.logit_bias.token_ids, self.logit_bias.bias)


class SamplingParams(RowSampling):
    max_tokens: int = Field(64, ge=0)  # 0 with prompt_logprobs scores a sequence
    stop_token_ids: TokenIds = Field(default_factory=empty_ids)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_cap(cls, value: int, info: ValidationInfo) -> int:
        cap = (info.context or {}).get("max_tokens_cap", MAX_TOKENS_CAP)
        if value > cap:
            raise PydanticCustomError("too_many_tokens", "max_tokens {value} is above the cap {cap}",
                                      {"value": value, "cap": cap})
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _few_stop_token_ids(cls, value: np.ndarray) -> np.ndarray:
        if len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(value)}")
        return value

    def row_sampling(self) -> RowSampling:
        return RowSampling(**{name: getattr(self, name) for name in RowSampling.model_fields})


class LogprobOptions(WireModel):
    """What the client wants besides tokens (docs/PROTOCOL.md#logprobs-and-sampling-masks).

    logprobs: top-n logprobs per completion token (0 = only the chosen token's); None = none.
    prompt_logprobs: the same for prompt positions. logprobs_mode: "raw" (log-softmax of the
    logits) or "processed" (of the distribution actually sampled from). logprob_token_ids:
    logprobs of these ids at every position. sampling_mask: return the candidate set K per
    token, at most max_mask_size ids (beyond that it is reported truncated).
    """

    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    logprobs_mode: LogprobsMode = "raw"
    logprob_token_ids: TokenIds = Field(default_factory=empty_ids)
    sampling_mask: bool = False
    max_mask_size: int = Field(4096, ge=1, le=MAX_MASK_SIZE)

    @field_validator("logprob_token_ids")
    @classmethod
    def _few_token_ids(cls, value: np.ndarray) -> np.ndarray:
        if len(value) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"at most {MAX_LOGPROB_TOKEN_IDS} logprob token ids, got {len(value)}")
        return value

    @property
    def wants_side_channel(self) -> bool:
        return (self.logprobs is not None or self.prompt_logprobs is not None
                or len(self.logprob_token_ids) > 0 or self.sampling_mask)


class SpeculativeOptions(WireModel):
    """draft_method: which drafters a request may use (docs/PROTOCOL.md#draft-methods). "model":
    a draft model; "ngram": prompt lookup (no model); "eagle": a head over the target's own
    features; "auto": whichever kind is live, and with several the one that measures better for
    this request (services/pipeline/draft_method.py)."""

    # 0 = plain decoding; else the most drafts a step takes (docs/PROTOCOL.md#adaptive-k)
    num_speculative_tokens: int = Field(4, ge=0, le=MAX_SPECULATIVE_TOKENS)
    draft_mode: Literal["greedy", "sample"] = "greedy"
    draft_method: Literal["auto", "model", "ngram", "eagle"] = "auto"


# ---------------------------------------------------------------- client <-> service


class ChatMessage(WireModel):
    """One turn of a chat: its role (system, user, assistant, or any other the template knows) and text."""

    role: str = Field(min_length=1, max_length=64)
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class GenerateRequest(Message):
    """client -> scheduler. Exactly one of prompt / prompt_token_ids / messages, non-empty.

    messages: a chat; the scheduler renders it with the target's chat template (a generation
    prompt added) and encodes the text, so a client needs no model files.

    timeout_s is relative; the scheduler turns it into an absolute deadline on arrival.
    stream=False: the client gets a single final chunk holding everything.
    resume_token_ids: completion tokens the client already has (its scheduler died): the request
    continues after them at the same absolute positions (the same seed, so the same draws) and
    streams only what follows; max_tokens still counts them. Give an explicit seed for a sampled
    request: the default seed comes from the request_id, which a resumed request changes.
    """

    type: Literal["generate"] = "generate"
    request_id: RequestId
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    prompt_token_ids: TokenIds | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_CHAT_MESSAGES)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    logprobs: LogprobOptions = Field(default_factory=LogprobOptions)
    speculative: SpeculativeOptions = Field(default_factory=SpeculativeOptions)
    timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    stream: bool = True
    resume_token_ids: TokenIds | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if sum(given is not None for given in (self.prompt, self.prompt_token_ids, self.messages)) != 1:
            raise field_error("prompt", "give exactly one of prompt and prompt_token_ids, or messages")
        if self.messages is not None and not self.messages:
            raise field_error("messages", "messages is empty")
        if self.prompt is not None and not self.prompt:
            raise field_error("prompt", "prompt is empty")
        if self.prompt_token_ids is not None and not len(self.prompt_token_ids):
            raise field_error("prompt_token_ids", "prompt_token_ids is empty")
        return self

    @model_validator(mode="after")
    def _seeded(self) -> "GenerateRequest":
        """A sampled request without a seed gets one from its id, here and only here (where
        every request is built or decoded), so every run, retry, migration and failover of it
        draws the same tokens; the scheduler, drafter and verifier only read it."""
        if not self.sampling.greedy and self.sampling.seed is None:
            self.sampling = self.sampling.model_copy(update={"seed": seed_from_request_id(self.request_id)})
        return self


def check_limits(request: GenerateRequest, *, max_tokens_cap: int = MAX_TOKENS_CAP) -> None:
    """A scheduler's own limits on an already valid request; raises SpecbusError naming the field."""
    if request.sampling.max_tokens > max_tokens_cap:
        raise SpecbusError(ErrorCode.invalid_field,
                           f"max_tokens {request.sampling.max_tokens} is above the cap {max_tokens_cap}",
                           "sampling.max_tokens")


class CancelRequest(Message):
    type: Literal["cancel"] = "cancel"
    request_id: RequestId


class Error(Message):
    """An error reply, or the error of a failed stream (StreamChunk.error)."""

    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    field: str | None = None
    request_id: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, request_id: str | None = None) -> "Error":
        """A SpecbusError keeps its code, message and field; anything else becomes a generic
        `internal` error (its details belong in the server log, not on the wire)."""
        if isinstance(exc, SpecbusError):
            return cls(code=exc.code, message=exc.message, field=exc.field, request_id=request_id)
        return cls(code=ErrorCode.internal, message="internal error", request_id=request_id)


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
    completion_tokens: Count = 0
    draft_tokens_proposed: Count = 0
    draft_tokens_accepted: Count = 0
    acceptance_rate: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    steps: Count = 0
    degraded_steps: dict[DegradedReason, Count] = Field(default_factory=dict)
    speculative_lengths: list[Count] = Field(
        default_factory=list, max_length=MAX_SPECULATIVE_TOKENS + 1,
        description="[k]: decode steps that verified k drafts (the scheduler picks k per step up to "
                    "num_speculative_tokens; a step degraded to no drafts counts at 0)")


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


# ---------------------------------------------------------------- scheduler <-> drafter / verifier


class Proposal(WireModel):
    """The distributions the draft tokens were drawn from (docs/PROTOCOL.md#proposal), n = #drafts.

    point_mass: no arrays; p_i is one-hot at the draft token (greedy / top-1 drafts).
    sparse: ids [n, S] (TARGET vocabulary ids, -1 = padding with prob 0) and probs [n, S].
    dense: probs [n, V_draft] over the DRAFT vocabulary (the verifier maps it with d2t),
           draft_vocab_size = V_draft.
    """

    kind: Literal["point_mass", "sparse", "dense"] = "point_mass"
    ids: IdMatrix | None = None
    probs: ProbMatrix | None = None
    draft_vocab_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _arrays_match_kind(self) -> "Proposal":
        if self.kind == "point_mass":
            for name in ("ids", "probs", "draft_vocab_size"):
                if getattr(self, name) is not None:
                    raise field_error(name, f"a point_mass proposal carries no {name}")
        elif self.probs is None:
            raise field_error("probs", f"a {self.kind} proposal needs probs")
        elif self.kind == "sparse":
            if self.ids is None or self.ids.shape != self.probs.shape:
                shape = None if self.ids is None else list(self.ids.shape)
                raise field_error("ids", f"a sparse proposal needs ids shaped like probs {list(self.probs.shape)}, "
                                         f"got {shape}")
            if self.draft_vocab_size is not None:
                raise field_error("draft_vocab_size", "only a dense proposal has a draft vocabulary size")
        else:
            if self.ids is not None:
                raise field_error("ids", "a dense proposal carries no ids")
            if self.draft_vocab_size != self.probs.shape[1]:
                raise field_error("draft_vocab_size",
                                  f"draft_vocab_size {self.draft_vocab_size} != probs width {self.probs.shape[1]}")
        return self


def check_drafts(draft_token_ids: np.ndarray, proposal: Proposal) -> None:
    """Drafts and proposal must agree: one proposal row per draft token, and a sparse
    support must give each draft token a non-zero probability (else rejection divides by 0)."""
    num_draft = len(draft_token_ids)
    if num_draft > MAX_SPECULATIVE_TOKENS:
        raise field_error("draft_token_ids", f"at most {MAX_SPECULATIVE_TOKENS} draft tokens, got {num_draft}")
    if proposal.probs is not None and proposal.probs.shape[0] != num_draft:
        raise field_error("proposal.probs", f"{proposal.probs.shape[0]} proposal rows for {num_draft} draft tokens")
    if proposal.kind == "sparse":
        in_support = ((proposal.ids == draft_token_ids[:, None]) & (proposal.probs > 0)).any(axis=1)
        if not in_support.all():
            position = int(np.argmin(in_support))
            raise field_error("proposal.ids", f"draft token at position {position} has no probability in the support")


def check_accepted(num_draft: int, num_accepted: int) -> None:
    if num_accepted > num_draft:
        raise field_error("num_accepted", f"{num_accepted} accepted of {num_draft} drafts")


def check_rows(rows: list[Any]) -> None:
    """Within one batch each request appears once, and (in requests; results carry no row
    index) row indices are distinct."""
    seen_ids: set[str] = set()
    seen_rows: set[int] = set()
    for index, row in enumerate(rows):
        if row.request_id in seen_ids:
            raise field_error(f"rows[{index}].request_id", f"request {row.request_id} appears twice in the batch")
        seen_ids.add(row.request_id)
        if hasattr(row, "row"):
            if row.row in seen_rows:
                raise field_error(f"rows[{index}].row", f"row index {row.row} appears twice in the batch")
            seen_rows.add(row.row)


class Batch(Message):
    """One message per batch step: `rows` (declared by each subclass) hold each request at most once."""

    batch_id: Count  # unique and increasing per scheduler

    @model_validator(mode="after")
    def _unique_rows(self) -> "Batch":
        check_rows(self.rows)
        return self


class DraftTokens(WireModel):
    """Draft tokens, as TARGET vocabulary ids (the drafter maps them with d2t), and the
    proposal they were drawn from; the two must agree (check_drafts)."""

    draft_token_ids: TokenIds = Field(default_factory=empty_ids)
    proposal: Proposal = Field(default_factory=Proposal)

    @model_validator(mode="after")
    def _drafts_match_proposal(self) -> "DraftTokens":
        check_drafts(self.draft_token_ids, self.proposal)
        return self


class FeatureBlock(WireModel):
    """The target's features at consecutive history positions (docs/PROTOCOL.md#feature-level-drafts).

    start: the history position of row 0. shape: [n, E], n >= 1 positions of E values, E the
    target's hidden size, 2 x n x E at most MAX_FEATURE_BLOCK_BYTES. data: n x E little-endian
    bfloat16 values, row-major: row i is the final-normed hidden state at position start + i (what
    the target's lm_head reads), rounded to bf16.
    """

    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64")

    start: Count
    shape: list[int] = Field(min_length=2, max_length=2)
    dtype: Literal["bfloat16"] = "bfloat16"
    data: bytes = Field(strict=True)

    @model_validator(mode="after")
    def _sizes_agree(self) -> "FeatureBlock":
        n, e = self.shape
        if n < 1 or not 1 <= e <= MAX_FEATURE_SIZE:
            raise field_error("shape", f"shape {self.shape}: a block holds n >= 1 positions of 1 <= E <= "
                                       f"{MAX_FEATURE_SIZE} values")
        if 2 * n * e > MAX_FEATURE_BLOCK_BYTES:
            raise field_error("shape", f"shape {self.shape} is {2 * n * e} bytes of bfloat16, over the "
                                       f"{MAX_FEATURE_BLOCK_BYTES} bytes of a block")
        if len(self.data) != 2 * n * e:
            raise field_error("data", f"{len(self.data)} bytes do not hold a bfloat16 matrix of shape "
                                      f"{self.shape} ({2 * n * e} bytes)")
        return self

    @property
    def end(self) -> int:
        """The history position after its last row."""
        return self.start + self.shape[0]


class DraftRow(WireModel):
    """One request in a DraftRequest.

    cached_len: committed tokens the scheduler expects the drafter to hold BEFORE appending
    new_token_ids (0 = start from scratch: new_token_ids is then the whole history).
    A drafter holding something else answers need_resync instead of guessing.
    prompt_len: history positions before it are the prompt, the rest the output, whose tokens
    the draft's own presence and frequency penalties count.
    features: for an eagle drafter, the target's features the scheduler received since it last
    gave this drafter some, joined (docs/PROTOCOL.md#feature-level-drafts); None for the others.
    """

    request_id: RequestId
    row: Count
    step: Count
    cached_len: Count
    new_token_ids: TokenIds = Field(default_factory=empty_ids)
    num_draft: int = Field(ge=0, le=MAX_SPECULATIVE_TOKENS)
    draft_mode: Literal["greedy", "sample"] = "greedy"
    sampling: RowSampling = Field(default_factory=RowSampling)
    prompt_len: Count = 0
    features: FeatureBlock | None = None


class DraftRequest(Batch):
    """release: requests whose slots the drafter must free (finished, cancelled, moved away);
    a batch may carry only releases and no rows."""

    type: Literal["draft_request"] = "draft_request"
    scheduler_id: InstanceId
    deadline: Deadline
    rows: list[DraftRow] = Field(max_length=MAX_BATCH_ROWS)
    release: list[RequestId] = Field(default_factory=list, max_length=MAX_BATCH_ROWS)


class DraftResult(DraftTokens):
    request_id: RequestId
    need_resync: bool = False


class DraftResponse(Batch):
    type: Literal["draft_response"] = "draft_response"
    drafter_id: InstanceId
    rows: list[DraftResult] = Field(max_length=MAX_BATCH_ROWS)


class VerifyRow(DraftTokens):
    """One request in a VerifyRequest.

    The verifier appends new_token_ids (committed, unseen by it) after cached_len tokens, then
    draft_token_ids, and verifies the drafts. prompt_len says which positions are prompt (for
    prompt logprobs). postprocessor_id: where the side channel goes (None = no side channel).
    is_retry: the same (request_id, step) was sent before; answer it again, never append twice.
    emit: False for a prefill chunk that stops short of the end of the history: append only,
    sample nothing. Prompt logprobs are accumulated over chunks and published in the side
    record of the row that completes the prompt.
    """

    request_id: RequestId
    row: Count
    step: Count
    cached_len: Count
    new_token_ids: TokenIds = Field(default_factory=empty_ids)
    sampling: RowSampling = Field(default_factory=RowSampling)
    logprobs: LogprobOptions = Field(default_factory=LogprobOptions)
    postprocessor_id: InstanceId | None = None
    prompt_len: Count
    is_retry: bool = False
    emit: bool = True
    features_from: Count | None = Field(None, description=(
        "the first history position whose target features the result carries, up to the last position the "
        "verifier holds after the step (docs/PROTOCOL.md#feature-level-drafts); None: no features"))


class VerifyRequest(Batch):
    """release: requests whose slots the verifier must free (finished, cancelled, moved away);
    a batch may carry only releases and no rows."""

    type: Literal["verify_request"] = "verify_request"
    scheduler_id: InstanceId
    deadline: Deadline
    rows: list[VerifyRow] = Field(max_length=MAX_BATCH_ROWS)
    release: list[RequestId] = Field(default_factory=list, max_length=MAX_BATCH_ROWS)


class VerifyResult(WireModel):
    """token_ids: the emitted tokens: num_accepted drafts then one recovered or bonus token,
    or none (a prefill chunk that emits nothing yet, need_resync, or error)."""

    request_id: RequestId
    step: Count
    token_ids: TokenIds = Field(default_factory=empty_ids)
    num_draft: int = Field(0, ge=0, le=MAX_SPECULATIVE_TOKENS)
    num_accepted: Count = 0
    need_resync: bool = False
    residual_fallback: bool = False  # the residual had zero mass; the target's own sample was emitted
    error: Error | None = None
    features: FeatureBlock | None = Field(None, description=(
        "the target's features of positions features_from up to the verifier's length after the step, at most "
        "MAX_FEATURE_BLOCK_BYTES of them; None when the row asked none or there are none"))

    @model_validator(mode="after")
    def _counts(self) -> "VerifyResult":
        check_accepted(self.num_draft, self.num_accepted)
        num_emitted = len(self.token_ids)
        if num_emitted != self.num_accepted + 1 and not (num_emitted == 0 and self.num_accepted == 0):
            raise field_error("token_ids", f"{num_emitted} tokens emitted for {self.num_accepted} accepted drafts")
        return self


class VerifyResponse(Batch):
    type: Literal["verify_response"] = "verify_response"
    verifier_id: InstanceId
    rows: list[VerifyResult] = Field(max_length=MAX_BATCH_ROWS)


# ---------------------------------------------------------------- verifier / scheduler -> postprocessor


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
    num_draft: int = Field(0, ge=0, le=MAX_SPECULATIVE_TOKENS)
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
    protocol_version: int = PROTOCOL_VERSION
    sent_at: float = Field(ge=0, allow_inf_nan=False)
    interval_s: float = Field(gt=0, allow_inf_nan=False)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.model_fields["type"].default: cls
    for cls in (GenerateRequest, CancelRequest, Error, StreamChunk, Admitted, DraftRequest, DraftResponse,
                VerifyRequest, VerifyResponse, SideChannelRecord, Commit, StopNotice, Heartbeat)
}
