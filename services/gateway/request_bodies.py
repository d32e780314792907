"""The request bodies of /v1/completions and /v1/chat/completions and their mapping to
GenerateRequests, NATS-free.

Bodies are pydantic models (FastAPI validates them): an unknown field is refused, naming it,
rather than silently ignored, and types are strict, as OpenAI's own server takes them: a number
given as a string (`"max_tokens": "8"`), a bool as 0/1 or a string for a number is refused naming
the field, never coerced (an integer is taken where a float is asked). Besides the OpenAI fields,
every body takes specbus's own (documented in docs/HTTP_API.md#specbuss-own-fields-and-usage): top_k, min_p,
ignore_eos, stop_token_ids, num_speculative_tokens, draft_mode, draft_method, logprobs_mode,
sampling_mask, timeout_s, vLLM's prompt_logprobs and structured_outputs (json, regex, choice,
grammar, json_object). OpenAI's response_format (json_object, json_schema) is taken on both
routes, as vLLM does; both become the request's sampling.structured_outputs, and an error in
them names the body's field (`response_format.json_schema.schema`, `structured_outputs.regex`).
A seed may be any signed 64-bit integer, as OpenAI and vLLM take it: it is used modulo 2**63.

One OpenAI request becomes one GenerateRequest per choice: `n` choices per prompt (seed + i when
a seed is given, else each request id's own seed), choice index prompt_index * n + i, as OpenAI
numbers them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.draft_kinds import DRAFT_METHOD_CHOICES
from schemas.errors import SpecbusError
from schemas.generation import GenerateRequest
from schemas.bus.protocol import MAX_TOP_LOGPROBS
from services.client import make_request
from services.gateway.api_errors import ApiError
from services.gateway.token_texts import TokenTexts
from services.gateway.tools import ToolFields, chat_input
from text.tokenizer import Tokenizer

MAX_CHOICES = 16  # n times the number of prompts
# Prompt logprob values one response may hold: choices x (top-N + 1) x prompt tokens, the tokens
# bounded by the prompt's UTF-8 bytes for a text (a byte-level token covers at least one byte)
# and the contents' bytes for a chat (its template's own tokens not counted); it bounds the
# response's size, which a request could otherwise make tens of megabytes
MAX_PROMPT_LOGPROB_VALUES = 1 << 16
MAX_ROLE_CHARS = 64  # as schemas.generation.ChatMessage takes it
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# specbus field name -> the body's name for it, where they differ
COMPLETION_PARAMS = {"prompt_token_ids": "prompt", "prompt_logprobs": "logprobs"}
CHAT_PARAMS = {"prompt": "messages", "logprobs": "top_logprobs"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no grammar), json_object, or json_schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json_object": True}
        if self.json_schema is None:
            raise ApiError(400, "response_format.json_schema: required with type json_schema",
                           param="response_format.json_schema", code="invalid_field")
        return {"json": self.json_schema.schema_ if self.json_schema.schema_ is not None else {}}


class SpecbusFields(BaseModel):
    """specbus's own fields (module docstring), which every route that generates takes: the
    completion and chat bodies, and /v1/responses and /v1/messages, which hand them to the chat
    body they become (`specbus_fields`). seed is OpenAI's on chat and completions, specbus's on
    the other two."""

    model_config = ConfigDict(extra="forbid", strict=True)

    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    num_speculative_tokens: int | None = None
    draft_mode: Literal["greedy", "sample"] | None = None
    draft_method: Literal[DRAFT_METHOD_CHOICES] | None = None
    coupling: Literal["rejection", "gumbel"] | None = None
    logprobs_mode: Literal["raw", "processed"] | None = None
    sampling_mask: bool | None = None
    timeout_s: float | None = Field(None, gt=0)  # none: the gateway's; 0 would be no time at all

    def specbus_fields(self) -> dict[str, Any]:
        """The fields of this mixin that were given, by name."""
        return {name: value for name in SpecbusFields.model_fields if (value := getattr(self, name)) is not None}


class Body(SpecbusFields):
    """What /v1/completions and /v1/chat/completions share: OpenAI's fields, specbus's
    (SpecbusFields), vLLM's."""

    model: str | None = None  # None: the one model served (as vLLM and SGLang take it)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {token id: bias}; ranges and ids checked by the schema
    repetition_penalty: float | None = None  # vLLM's extra
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's; checked by schemas.generation.StructuredOutputs
    user: str | None = None  # accepted for the SDKs; unused
    # vLLM's: the prompt's logprobs (top-N per token), module docstring
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def check_stream_rules(self) -> None:
        """OpenAI's rule: stream_options only with stream. vLLM's: the prompt's logprobs only in
        a whole response."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options: only allowed with stream=true", param="stream_options",
                           code="invalid_field")
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError(400, "prompt_logprobs: not available with stream=true", param="prompt_logprobs",
                           code="invalid_field")

    def common_options(self) -> dict[str, Any]:
        """make_request options from the shared fields (None: the schema's default)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "stop": [self.stop] if isinstance(self.stop, str)
                else self.stop, "top_k": self.top_k, "min_p": self.min_p, "ignore_eos": self.ignore_eos,
                "stop_token_ids": self.stop_token_ids, "num_speculative_tokens": self.num_speculative_tokens,
                "draft_mode": self.draft_mode, "draft_method": self.draft_method, "logprobs_mode": self.logprobs_mode,
                "sampling_mask": self.sampling_mask, "stream": self.stream,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias,
                "coupling": self.coupling, "structured_outputs": self.grammar()}

    def grammar(self) -> dict[str, Any] | None:
        """The request's structured_outputs: vLLM's field or OpenAI's response_format, not both."""
        given = self.response_format.structured_outputs() if self.response_format is not None else None
        if given is not None and self.structured_outputs is not None:
            raise ApiError(400, "structured_outputs: give it or response_format, not both", param="structured_outputs",
                           code="invalid_field")
        return given if given is not None else self.structured_outputs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def param_names(self) -> dict[str, str]:
        """specbus option -> the body's name for it, for the errors of this body's requests."""
        return self.grammar_names()

    def grammar_names(self) -> dict[str, str]:
        if self.response_format is None or self.response_format.type == "text":
            return {}
        return {"structured_outputs": "response_format.json_schema.schema" if self.response_format.type == "json_schema"
                else "response_format"}


class CompletionBody(Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    def param_names(self) -> dict[str, str]:
        # the request's prompt_logprobs come from `prompt_logprobs` when given, else from echo + logprobs
        names = dict(COMPLETION_PARAMS) | self.grammar_names()
        if self.prompt_logprobs is not None:
            del names["prompt_logprobs"]
        return names


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class OpenAIChatMessage(BaseModel):
    """A turn as vLLM takes it: any role the chat template knows (tool, ipython, ...), and fields
    beyond role and content accepted (name, tool_calls, tool_call_id, ...): an assistant's
    tool_calls and a tool turn are rendered by services/gateway/tools.py, other extra fields are
    not passed on. content null (an assistant turn of tool calls) is empty text."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(min_length=1, max_length=MAX_ROLE_CHARS)
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatBody(Body, ToolFields):
    """A chat body; its tool fields and their grammar are services/gateway/tools.py's."""

    messages: list[OpenAIChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def param_names(self) -> dict[str, str]:
        return CHAT_PARAMS | self.grammar_names() | {"max_tokens": "max_tokens" if self.max_completion_tokens is None
                              else "max_completion_tokens"}

    def grammar(self) -> dict[str, Any] | None:
        """tool_choice required / named is a grammar too: it or response_format / structured_outputs."""
        tools = self.tool_grammar()
        given = super().grammar()
        if tools is not None and given is not None:
            raise ApiError(400, "tool_choice: a required or named tool_choice cannot be combined with "
                                "response_format or structured_outputs", param="tool_choice", code="invalid_field")
        return tools if tools is not None else given

    def grammar_names(self) -> dict[str, str]:
        return {"structured_outputs": "tools"} if self.tool_mode() in ("required", "named") else super().grammar_names()


# ---------------------------------------------------------------------------------------------
# OpenAI request -> GenerateRequests


@dataclass(frozen=True)
class ChoicePlan:
    """One choice: its index in the response, its GenerateRequest, and for `echo` the prompt text."""

    index: int
    request: GenerateRequest
    echo_text: str | None = None


def plan_requests(inputs: Sequence[dict[str, Any]], n: int, seed: int | None, options: dict[str, Any],
                  param_names: Mapping[str, str], echo_texts: Sequence[str] | None = None) -> list[ChoicePlan]:
    """A GenerateRequest per choice (module docstring) from each input ({"prompt": ...} or
    {"messages": ...}); a bad value is a 400 naming the body's field."""
    if not inputs:
        raise ApiError(400, "prompt: give at least one prompt", param="prompt", code="invalid_field")
    if len(inputs) * n > MAX_CHOICES:
        raise ApiError(400, f"n: {len(inputs)} prompts x n={n} choices is above {MAX_CHOICES}", param="n",
                       code="invalid_field")
    check_prompt_logprob_values(inputs, n, options.get("prompt_logprobs"), param_names)
    plans = []
    for prompt_index, given in enumerate(inputs):
        for i in range(n):
            choice_seed = None if seed is None else (seed + i) % 2**63  # a negative seed too
            try:
                request = make_request(**given, seed=choice_seed, **options)
            except SpecbusError as exc:
                raise ApiError.from_specbus(exc, param_names) from None
            plans.append(ChoicePlan(prompt_index * n + i, request, None if echo_texts is None else echo_texts[prompt_index]))
    return plans


def check_prompt_logprob_values(inputs: Sequence[dict[str, Any]], n: int, top_n: int | None,
                                 param_names: Mapping[str, str]) -> None:
    """A 400 naming the field when the response would hold over MAX_PROMPT_LOGPROB_VALUES
    prompt logprob values (its comment: how the prompt tokens are bounded)."""
    if top_n is None:
        return
    tokens = 0
    for given in inputs:
        prompt = given.get("prompt")
        if prompt is None:
            tokens += sum(len(m["content"].encode()) for m in given["messages"])
        else:
            tokens += len(prompt.encode()) if isinstance(prompt, str) else len(prompt)
    values = n * (top_n + 1) * tokens
    if values > MAX_PROMPT_LOGPROB_VALUES:
        param = param_names.get("prompt_logprobs", "prompt_logprobs")
        raise ApiError(400, f"{param}: {n} choices x {top_n + 1} logprobs x up to {tokens} prompt tokens is "
                            f"{values} values, above {MAX_PROMPT_LOGPROB_VALUES} a response may hold",
                       param=param, code="invalid_field")


def completion_plans(body: CompletionBody, texts: TokenTexts, timeout_s: float) -> list[ChoicePlan]:
    """A prompt of token ids is echoed as its tokens' texts, special tokens included (module
    docstring: the offsets must agree with it); a text prompt as it was given."""
    body.check_stream_rules()
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of: only best_of == n is supported", param="best_of", code="invalid_field")
    # echo + logprobs scores the prompt too (max_tokens=0: only the prompt); with prompt_logprobs,
    # one request gives both, each cut to its own top-N
    wanted = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
    options = body.common_options() | {
        "max_tokens": COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
        "logprobs": body.logprobs, "timeout_s": timeout_s if body.timeout_s is None else body.timeout_s,
        "prompt_logprobs": max(wanted) if wanted else None,
    }
    prompts = body.prompts()
    echo_texts = [p if isinstance(p, str) else texts.join(p) for p in prompts] if body.echo else None
    return plan_requests([{"prompt": p} for p in prompts], body.n, body.seed, options, body.param_names(), echo_texts)


def chat_plans(body: ChatBody, default_max_tokens: int, timeout_s: float,
               tokenizer: Tokenizer | None = None) -> list[ChoicePlan]:
    """The messages go as they are: the scheduler renders them with the target's chat template
    (a model without one: a 400 naming messages); a chat with tools is rendered here with
    tokenizer's template (services/gateway/tools.py)."""
    body.check_stream_rules()
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs=true", param="top_logprobs", code="invalid_field")
    max_tokens = next((v for v in (body.max_completion_tokens, body.max_tokens) if v is not None), default_max_tokens)
    options = body.common_options() | {
        "max_tokens": max_tokens, "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
        "timeout_s": timeout_s if body.timeout_s is None else body.timeout_s, "prompt_logprobs": body.prompt_logprobs,
    }
    return plan_requests([chat_input(body, tokenizer)], body.n, body.seed, options, body.param_names())
