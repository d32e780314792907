"""What a client asks for: GenerateRequest with its sampling, logprob and speculative options,
and CancelRequest (docs/PROTOCOL.md#client-and-scheduler).

RowSampling is the part of SamplingParams that travels on with every draft and verify row.
`GenerateRequest` is where a sampled request without a seed gets one (`seed_from_request_id`),
so every hop after it only reads the seed.
"""

import hashlib
import json
import re
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from schemas.arrays import TokenIds, empty_ids
from schemas.draft_kinds import DRAFT_METHOD_CHOICES
from schemas.errors import ErrorCode, SpecbusError
from schemas.bus.protocol import (MAX_CHAT_MESSAGES, MAX_CHOICES, MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_LOGPROB_TOKEN_IDS,
                              MAX_MASK_SIZE, MAX_PENALTY, MAX_PROMPT_CHARS, MAX_REPETITION_PENALTY,
                              MAX_SPECULATIVE_TOKENS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                              MAX_TIMEOUT_S, MAX_TOKENS_CAP, MAX_TOP_K, MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY,
                              MIN_TEMPERATURE, MIN_TOP_P)
from schemas.bus.wire import BiasVector, LogprobsMode, Message, RequestId, StopString, WireModel, field_error


def new_request_id() -> str:
    return uuid.uuid4().hex


def seed_from_request_id(request_id: str) -> int:
    """A stable seed for a sampled request that gave none (0..2**63-1): the same id always draws
    the same tokens, whichever scheduler, verifier or drafter computes it."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little") & (2**63 - 1)


class LogitBias(WireModel):
    """OpenAI's logit_bias in packed form.

    token_ids / bias [n]: bias[i] is added to the logit of token_ids[i], before the penalties
    and the temperature. At most MAX_LOGIT_BIAS ids, each once; every bias finite and within
    +-MAX_LOGIT_BIAS_VALUE. The scheduler checks the ids against the vocabulary at admission,
    and the verifier again (a row with an id outside it fails naming `sampling.logit_bias`).
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


class StructuredOutputs(WireModel):
    """A grammar the output must follow (docs/PROTOCOL.md#structured-outputs), vLLM's
    `structured_outputs` fields: exactly one of json (a JSON schema, an object or its text),
    regex, choice (the output is one of these strings), grammar (a Lark grammar, llguidance's
    dialect) and json_object (any JSON object). At most MAX_GRAMMAR_CHARS characters in all.
    Whether the grammar compiles is the scheduler's check at admission (text/grammar.py)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool = False

    model_config = WireModel.model_config | {"populate_by_name": True, "serialize_by_alias": True}

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name in ("json", "regex", "choice", "grammar") if self.value(name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar and json_object; got "
                             f"{', '.join(given) or 'none'}")
        if isinstance(self.json_, str):
            try:
                self.json_ = json.loads(self.json_)
            except ValueError as exc:
                raise field_error("json", f"the schema is not valid JSON: {exc}") from None
            if not isinstance(self.json_, dict):
                raise field_error("json", "a JSON schema is an object")
        size = len(json.dumps(self.model_dump(mode="json", exclude_none=True)))
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the grammar is {size} characters, over the {MAX_GRAMMAR_CHARS} allowed")
        return self

    def value(self, name: str):
        return self.json_ if name == "json" else getattr(self, name)

    @property
    def json(self) -> dict[str, Any] | None:
        return self.json_


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
    structured_outputs: StructuredOutputs | None = Field(
        None, description="a grammar the output follows (docs/PROTOCOL.md#structured-outputs); None = free text")
    coupling: Literal["rejection", "gumbel"] = Field(
        "gumbel", description="how a sampled row's drafts are accepted: Gumbel-max coupling, whose output depends on "
                              "(seed, prompt, sampling) only, not on k or the draft, or rejection sampling "
                              "(docs/PROTOCOL.md#drafter-invariant-sampling); greedy rows ignore it")

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
        """logit_bias, a penalty or a grammar is on: a position's logits are more than the model's."""
        return self.penalties_on or self.structured_outputs is not None

    @property
    def penalties_on(self) -> bool:
        """logit_bias or a penalty is on (a grammar aside): the row needs its history's counts."""
        return (self.logit_bias is not None or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """Its packed arrays (the logit bias), for a sender that sizes a batch by them."""
        return () if self.logit_bias is None else (self.logit_bias.token_ids, self.logit_bias.bias)


def draft_is_sampled(sampling: RowSampling, draft_mode: str) -> bool:
    """Whether a draft row's drafts are drawn from a distribution rather than taken as the argmax:
    every row that is not greedy (temperature 0) and either drafts in mode "sample" or is
    Gumbel-coupled (a coupled row proposes with the target's noise whatever its draft_mode). A
    drawn row of mode "sample" answers a sparse proposal (up to MAX_DRAFT_SUPPORT ids per draft), a
    Gumbel-coupled one a point mass (its acceptance reads no draft law); the scheduler sizes either
    answer for the sparse one, an upper bound."""
    return not sampling.greedy and (draft_mode == "sample" or sampling.gumbel)


class SamplingParams(RowSampling):
    max_tokens: int = Field(64, ge=0)  # 0 with prompt_logprobs scores a sequence
    stop_token_ids: TokenIds = Field(default_factory=empty_ids)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_cap(cls, value: int, info: ValidationInfo) -> int:
        cap = (info.context or {}).get("max_tokens_cap", MAX_TOKENS_CAP)  # None: checked elsewhere
        if cap is not None and value > cap:
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
    this request (services/scheduler/drafts/draft_method.py), and per step the scheduler's suffix index
    where its drafts pay more (services/scheduler/drafts/suffix_choice.py); "suffix": the suffix index's
    drafts only, no drafter."""

    # 0 = plain decoding; else the most drafts a step takes (docs/PROTOCOL.md#adaptive-k)
    num_speculative_tokens: int = Field(4, ge=0, le=MAX_SPECULATIVE_TOKENS)
    draft_mode: Literal["greedy", "sample"] = "greedy"
    draft_method: Literal[DRAFT_METHOD_CHOICES] = "auto"


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


def check_limits(request: GenerateRequest, *, max_tokens_cap: int = MAX_TOKENS_CAP,
                 max_model_len: int | None = None) -> None:
    """A scheduler's own limits on an already valid request; raises SpecbusError naming the field.
    The max_tokens cap is the least of max_tokens_cap and max_model_len (the verifiers'
    max_seq_len, None while none is known), and the message states that cap and, when
    max_model_len is the lower, both."""
    cap = max_tokens_cap if max_model_len is None else min(max_tokens_cap, max_model_len)
    if request.sampling.max_tokens > cap:
        why = f" (max_model_len {max_model_len}; max_tokens_cap {max_tokens_cap})" if cap < max_tokens_cap else ""
        raise SpecbusError(ErrorCode.invalid_field, f"max_tokens {request.sampling.max_tokens} is above the cap {cap}"
                                                    f"{why}", "sampling.max_tokens")


class CancelRequest(Message):
    type: Literal["cancel"] = "cancel"
    request_id: RequestId
