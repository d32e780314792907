"""The OpenAI API's side of the gateway, NATS-free: request bodies, their mapping to
GenerateRequests, StreamChunks turned into OpenAI responses and SSE chunks, errors.

Request bodies are pydantic models (FastAPI validates them; an unknown field is refused, naming
it, rather than silently ignored). Besides the OpenAI fields, every body takes specbus's own
(documented in README.md, "OpenAI-compatible API"): top_k, min_p, ignore_eos, stop_token_ids,
num_speculative_tokens, draft_mode, draft_method, logprobs_mode, sampling_mask, timeout_s, and vLLM's
prompt_logprobs. `usage` holds OpenAI's fields only, the draft tokens as OpenAI counts predicted
outputs (completion_tokens_details.accepted_prediction_tokens / rejected_prediction_tokens: a
draft token the target kept / one it refused); our extras sit next to the OpenAI fields: a
top-level `speculation` {draft_tokens_proposed, draft_tokens_accepted, acceptance_rate, steps,
speculative_lengths} wherever `usage` is, and per choice `degraded`: in a streamed chunk the reasons that chunk was
flagged with (e.g. draft_timeout), in a whole response every reason seen, when there is any.

One OpenAI request becomes one GenerateRequest per choice: `n` choices per prompt (seed + i when
a seed is given, else each request id's own seed), choice index prompt_index * n + i, as OpenAI
numbers them. `usage` sums the choices, counting each prompt's tokens once.

Logprob shapes (as vLLM's OpenAI server gives them):
- completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"};
  a top_logprobs dict holds the top-N and the chosen token; with `echo` the prompt tokens come
  first, the first one with logprob null (it has no context). text_offset[i] is where token i
  begins in the choice's text, so the offsets always agree with the text returned: an echoed
  prompt given as token ids is the concatenation of its tokens, special tokens included (as text
  it is echoed as given); a generated special token, which the text leaves out, takes no room;
  a character split across tokens begins in the first of them.
- prompt_logprobs (vLLM's extension): per prompt token null (the first) or {token id: {"logprob",
  "rank", "decoded_token"}} for the top-N and the prompt's own token; per choice in completions,
  next to `choices` in chat completions.
- chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
A token's text is its own bytes decoded (a token that ends inside a UTF-8 character shows U+FFFD;
`bytes` keeps the exact bytes). A logprob of -inf (outside the candidate set in logprobs_mode
"processed") is written -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import hmac
import json
import math
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from text.tokenizer import Tokenizer
from schemas.config import GatewayConfig
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import GenerateRequest
from schemas.protocol import MAX_TOP_LOGPROBS
from schemas.streams import StreamChunk, TokenLogprob, Usage
from services.runtime.auth import AuthConfigError, api_key_env, client_user_names, password_env
from services.client import make_request

MAX_CHOICES = 16  # n times the number of prompts
# An input echoed in an error message is cut to this many characters (an 8 MB model name must not
# come back whole); a whole message and its param are cut too, whatever they hold.
MAX_ECHO_CHARS = 64
MAX_MESSAGE_CHARS = 1024
MAX_PARAM_CHARS = 128
MAX_ROLE_CHARS = 64  # as schemas.generation.ChatMessage takes it
NEG_INF_LOGPROB = -9999.0
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
HEARTBEATS_MISSED = 3  # a verifier silent for this many of its intervals no longer counts for max_model_len
# specbus field name -> the body's name for it, where they differ
COMPLETION_PARAMS = {"prompt_token_ids": "prompt", "prompt_logprobs": "logprobs"}
CHAT_PARAMS = {"prompt": "messages", "logprobs": "top_logprobs"}

# ErrorCode -> (HTTP status, OpenAI error type); a code missing here is a 500
STATUS_OF_CODE: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.bad_request: (400, "invalid_request_error"),
    ErrorCode.invalid_field: (400, "invalid_request_error"),
    ErrorCode.unsupported_version: (400, "invalid_request_error"),
    ErrorCode.wrong_message_type: (400, "invalid_request_error"),
    ErrorCode.malformed: (400, "invalid_request_error"),
    ErrorCode.too_large: (400, "invalid_request_error"),
    ErrorCode.forbidden: (403, "permission_error"),
    ErrorCode.not_found: (404, "not_found_error"),
    ErrorCode.duplicate_request_id: (409, "invalid_request_error"),
    ErrorCode.overloaded: (429, "rate_limit_error"),
    ErrorCode.no_capacity: (503, "service_unavailable"),
    ErrorCode.unavailable: (503, "service_unavailable"),
    ErrorCode.shutting_down: (503, "service_unavailable"),
    ErrorCode.timeout: (504, "timeout"),
    ErrorCode.cancelled: (500, "server_error"),
    ErrorCode.need_resync: (500, "server_error"),
    ErrorCode.internal: (500, "server_error"),
}


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """text, or its first `limit` characters and how long it was: an input echoed in a message."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ApiError(Exception):
    """An OpenAI error object with its HTTP status: {"error": {"message", "type", "param", "code"}}.
    message and param are clipped (MAX_MESSAGE_CHARS, MAX_PARAM_CHARS): they may hold inputs."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        message = clip(message, MAX_MESSAGE_CHARS)
        param = None if param is None else clip(param, MAX_PARAM_CHARS)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_specbus(cls, exc: SpecbusError, param_names: Mapping[str, str] = {}) -> ApiError:
        """The OpenAI error for a specbus error; its field ("sampling.top_p") becomes the body's
        name for it (param_names: specbus option -> body field, e.g. logprobs -> top_logprobs)."""
        status, kind = STATUS_OF_CODE.get(exc.code, (500, "server_error"))  # a code newer than this table
        param = None
        if exc.field:
            name = exc.field.rsplit(".", 1)[-1]
            param = param_names.get(name, name)
        return cls(status, f"{param}: {exc.message}" if param else exc.message, type=kind, param=param,
                   code=exc.code.value)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """A 400 for pydantic's (FastAPI's) validation errors: the first, its location as param
    ("messages[0].role"; "body" and pydantic's union-member tags left out). A body that is not
    JSON is FastAPI's `json_invalid` error, located at a character position, not a field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first.get("loc", ())[1:]
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        at = f" at character {where[0]}" if where and isinstance(where[0], int) else ""
        return ApiError(400, f"the body is not valid JSON: {detail}{at}", code="invalid_json")
    path = ""
    for part in first.get("loc", ())[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", str(part)) and part not in ("str", "int", "float", "bool"):
            path += f".{part}" if path else str(part)
        else:
            break
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"{clip(path)}: {message}" if path else message, param=path or None,
                    code="invalid_field" if path else "bad_request")


# The errors the web framework answers by itself (Starlette's HTTPException), as OpenAI errors.
FRAMEWORK_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}


def framework_error(status: int, method: str, path: str, allowed: str | None = None) -> ApiError:
    """The OpenAI error for what Starlette refuses before a handler runs: an unknown route (404),
    a method the route does not take (405), a body it cannot parse (400: not UTF-8 JSON)."""
    route = f"{method} {clip(path)}"
    if status == 404:
        message = f"no such route: {route}"
    elif status == 405:
        message = f"method not allowed: {route}" + (f" (allowed: {allowed})" if allowed else "")
    elif status == 400:
        message = "the body is not valid JSON (it must be UTF-8 encoded)"
    else:
        message = f"{route}: HTTP {status}"
    kind = "server_error" if status >= 500 else ("not_found_error" if status == 404 else "invalid_request_error")
    return ApiError(status, message, type=kind, code=FRAMEWORK_CODES.get(status, f"http_{status}"))


# ---------------------------------------------------------------------------------------------
# limits before work: what the gateway checks before it reads a body


def needs_api_key(path: str) -> bool:
    """Everything under /v1 needs a key (even a route that does not exist: the key is checked
    before anything else); /health, /metrics and the OpenAPI docs do not."""
    return path == "/v1" or path.startswith("/v1/")


def check_header_size(headers: Sequence[tuple[bytes, bytes]], max_header_bytes: int) -> None:
    """A 431 for headers over max_header_bytes (h11 bounds only a head that arrives in pieces)."""
    size = sum(len(name) + len(value) + 4 for name, value in headers)
    if size > max_header_bytes:
        raise headers_too_large(max_header_bytes)


def headers_too_large(max_header_bytes: int) -> ApiError:
    return ApiError(431, f"the request headers are over {max_header_bytes} bytes (max_header_bytes)",
                    code="headers_too_large")


def declared_length(headers: Sequence[tuple[bytes, bytes]], max_body_bytes: int) -> int | None:
    """The body's Content-Length (None: not given, e.g. chunked); a 413 over max_body_bytes, a
    400 for a value that is not a number."""
    values = [value for name, value in headers if name.lower() == b"content-length"]
    if not values:
        return None
    try:
        length = int(values[0])
    except ValueError:
        raise ApiError(400, "Content-Length is not a number", code="bad_request") from None
    if length > max_body_bytes:
        raise body_too_large(max_body_bytes)
    return length


def body_too_large(max_body_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is over {max_body_bytes} bytes (max_body_bytes)",
                    code="request_too_large")


def body_too_slow(body_timeout_s: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {body_timeout_s:g} s (body_timeout_s)",
                    type="timeout", code="request_timeout")


def check_gateway_limits(config: GatewayConfig) -> None:
    """SpecbusError naming the first GatewayConfig limit that is not positive."""
    for name in ("max_body_bytes", "body_timeout_s", "header_timeout_s", "keep_alive_timeout_s", "max_header_bytes"):
        if not getattr(config, name) > 0:
            raise SpecbusError(ErrorCode.invalid_field, f"must be > 0, got {getattr(config, name)!r}", name)


# ---------------------------------------------------------------------------------------------
# API keys: SPECBUS_<USER>_API_KEY per client user


@dataclass(frozen=True)
class Login:
    user: str
    password: str
    api_key: str


def gateway_logins(env: Mapping[str, str]) -> list[Login]:
    """Every client user in SPECBUS_CLIENT_USERS with its NATS password and API key;
    AuthConfigError naming the variable that is missing."""
    logins = []
    for user in client_user_names(env):
        password, api_key = env.get(password_env(user), ""), env.get(api_key_env(user), "")
        for variable, value in ((password_env(user), password), (api_key_env(user), api_key)):
            if not value:
                raise AuthConfigError(f"the gateway needs it for the client user {user!r}", variable)
        logins.append(Login(user, password, api_key))
    return logins


def user_for_key(logins: Sequence[Login], authorization: str | None) -> str:
    """The client user whose key is in `Authorization: Bearer <key>`; 401 otherwise. Every key is
    compared in constant time."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
    found = [login.user for login in logins if hmac.compare_digest(login.api_key.encode(), key.strip().encode())]
    if not found:
        raise ApiError(401, "incorrect API key", code="invalid_api_key")
    return found[0]


# ---------------------------------------------------------------------------------------------
# request bodies


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Body(BaseModel):
    """What /v1/completions and /v1/chat/completions share, OpenAI's fields then specbus's."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the one model served (as vLLM and SGLang take it)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {token id: bias}; ranges and ids checked by the schema
    repetition_penalty: float | None = None  # vLLM's extra
    user: str | None = None  # accepted for the SDKs; unused
    # specbus's own
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    num_speculative_tokens: int | None = None
    draft_mode: Literal["greedy", "sample"] | None = None
    draft_method: Literal["auto", "model", "ngram", "eagle"] | None = None
    coupling: Literal["rejection", "gumbel"] | None = None
    logprobs_mode: Literal["raw", "processed"] | None = None
    sampling_mask: bool | None = None
    timeout_s: float | None = None
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
                "coupling": self.coupling}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def param_names(self) -> dict[str, str]:
        """specbus option -> the body's name for it, for the errors of this body's requests."""
        return {}


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
        names = dict(COMPLETION_PARAMS)
        if self.prompt_logprobs is not None:
            del names["prompt_logprobs"]
        return names


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class OpenAIChatMessage(BaseModel):
    """A turn as vLLM takes it: any role the chat template knows (tool, ipython, ...), and fields
    beyond role and content accepted (name, tool_calls, ...) but not passed on: a GenerateRequest's
    messages carry role and content, which is all the template is given (README.md, deliberate
    differences). content null (an assistant turn of tool calls) is empty text."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1, max_length=MAX_ROLE_CHARS)
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatBody(Body):
    messages: list[OpenAIChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def param_names(self) -> dict[str, str]:
        return CHAT_PARAMS | {"max_tokens": "max_tokens" if self.max_completion_tokens is None
                              else "max_completion_tokens"}


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
    plans = []
    for prompt_index, given in enumerate(inputs):
        for i in range(n):
            choice_seed = None if seed is None else (seed + i) % 2**63
            try:
                request = make_request(**given, seed=choice_seed, **options)
            except SpecbusError as exc:
                raise ApiError.from_specbus(exc, param_names) from None
            plans.append(ChoicePlan(prompt_index * n + i, request, None if echo_texts is None else echo_texts[prompt_index]))
    return plans


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
        "logprobs": body.logprobs, "timeout_s": body.timeout_s or timeout_s,
        "prompt_logprobs": max(wanted) if wanted else None,
    }
    prompts = body.prompts()
    echo_texts = [p if isinstance(p, str) else texts.join(p) for p in prompts] if body.echo else None
    return plan_requests([{"prompt": p} for p in prompts], body.n, body.seed, options, body.param_names(), echo_texts)


def chat_plans(body: ChatBody, default_max_tokens: int, timeout_s: float) -> list[ChoicePlan]:
    """The messages go as they are: the scheduler renders them with the target's chat template
    (a model without one: a 400 naming messages)."""
    body.check_stream_rules()
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs=true", param="top_logprobs", code="invalid_field")
    max_tokens = next((v for v in (body.max_completion_tokens, body.max_tokens) if v is not None), default_max_tokens)
    options = body.common_options() | {
        "max_tokens": max_tokens, "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
        "timeout_s": body.timeout_s or timeout_s, "prompt_logprobs": body.prompt_logprobs,
    }
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return plan_requests([{"messages": messages}], body.n, body.seed, options, body.param_names())


# ---------------------------------------------------------------------------------------------
# token texts


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet reversed (character -> byte): printable bytes stand for
    themselves, the others are shifted to 256 + i (openai/gpt-2 src/encoder.py, bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + sum(1 for other in range(b) if other not in printable)
    return {chr(c): b for b, c in chars.items()}


class TokenTexts:
    """Per-token bytes and text for the logprob shapes (module docstring), cached by id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        described = json.loads(tokenizer.hf.to_str())
        self.byte_level = (described.get("decoder") or {}).get("type") == "ByteLevel"
        added = described.get("added_tokens", [])
        self.special = {t["id"] for t in added}  # written as they are, not byte-level encoded
        self.skipped = {t["id"] for t in added if t.get("special")}  # left out of generated text
        self.cache: dict[int, tuple[bytes, str]] = {}

    def get(self, token_id: int) -> tuple[bytes, str]:
        if token_id not in self.cache:
            piece = self.tokenizer.hf.id_to_token(token_id) or ""
            if self.byte_level and token_id not in self.special:
                decoder = byte_decoder()
                raw = bytes(decoder[c] for c in piece if c in decoder)
            elif self.byte_level:
                raw = piece.encode()
            else:
                raw = self.tokenizer.decode([token_id]).encode()
            self.cache[token_id] = (raw, raw.decode("utf-8", errors="replace"))
        return self.cache[token_id]

    def text(self, token_id: int) -> str:
        return self.get(token_id)[1]

    def join(self, ids: Sequence[int]) -> str:
        """The text of tokens in a row, special tokens included: the bytes joined, then decoded
        (a character split across tokens comes out whole)."""
        if self.byte_level:
            return b"".join(self.get(i)[0] for i in ids).decode("utf-8", errors="replace")
        return "".join(self.text(i) for i in ids)

    def width(self, token_id: int) -> int:
        """Characters a token adds to a text (join's): the characters that begin in its bytes (a
        UTF-8 continuation byte begins none)."""
        if self.byte_level:
            return sum(1 for b in self.get(token_id)[0] if b & 0xC0 != 0x80)
        return len(self.text(token_id))


def json_logprob(value: float) -> float:
    return NEG_INF_LOGPROB if math.isinf(value) else value


# ---------------------------------------------------------------------------------------------
# StreamChunks -> OpenAI choices


@dataclass
class Choice:
    """One choice's state across its chunks: what was sent so far and the logprobs wanted."""

    index: int
    texts: TokenTexts
    top_n: int | None  # logprobs wanted: top-N per token (0: the chosen one's); None: none
    echo_text: str | None = None
    prompt_top_n: int | None = None  # vLLM's prompt_logprobs wanted: top-N per prompt token
    text_offset: int = 0  # completions: characters of this choice's text so far (module docstring)
    finish_reason: str | None = None
    usage: Usage | None = None
    started: bool = False
    prompt_logprobs: list[dict | None] | None = None  # vLLM's shape, once the first chunk came

    def finish(self, chunk: StreamChunk) -> str | None:
        """The OpenAI finish_reason of a chunk; a request that timed out or was cancelled is an error."""
        if not chunk.final:
            return None
        if chunk.finish_reason == "timeout":
            raise ApiError(504, "the request ran past its timeout_s", type="timeout", code="timeout")
        if chunk.finish_reason not in FINISH_REASONS:
            raise ApiError(500, f"the request ended with {chunk.finish_reason!r}", type="server_error",
                           code=chunk.finish_reason)
        self.finish_reason, self.usage = FINISH_REASONS[chunk.finish_reason], chunk.usage
        return self.finish_reason

    def first_chunk(self, chunk: StreamChunk) -> bool:
        """True for the choice's first chunk (which carries the prompt's ids and logprobs when
        asked); keeps the prompt logprobs in vLLM's shape."""
        if self.started:
            return False
        self.started = True
        if self.prompt_top_n is not None and chunk.prompt_token_ids is not None:
            self.prompt_logprobs = vllm_prompt_logprobs(self.texts, chunk.prompt_token_ids.tolist(),
                                                        chunk.prompt_logprobs, self.prompt_top_n)
        return True

    def completion_piece(self, chunk: StreamChunk) -> dict:
        """The choice's part of a completion (its text so far or its delta), with logprobs."""
        text, ids = chunk.text, chunk.token_ids.tolist()
        entries = list(chunk.logprobs) if chunk.logprobs is not None else [None] * len(ids)
        first = self.first_chunk(chunk)
        prompt_ids: list[int] = []
        prompt_entries: list[TokenLogprob | None] = []
        if first and self.echo_text is not None:
            echoed = self.echo_text
            if self.top_n is not None and chunk.prompt_token_ids is not None:
                # the prompt's tokens are listed: the echoed text is theirs, so the offsets agree with it
                prompt_ids = chunk.prompt_token_ids.tolist()
                prompt_entries = list(chunk.prompt_logprobs or [None] * len(prompt_ids))
                echoed = self.texts.join(prompt_ids)
            elif self.top_n is not None:  # no prompt tokens came: the text's characters still count
                self.text_offset += len(echoed)
            text = echoed + text
        logprobs = None
        if self.top_n is not None:
            echoed_part = self.completion_logprobs(prompt_ids, prompt_entries, echo=True)
            generated = self.completion_logprobs(ids, entries, echo=False)
            logprobs = {key: echoed_part[key] + generated[key] for key in generated}
        piece = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish(chunk)}
        if first and self.prompt_top_n is not None:
            piece["prompt_logprobs"] = self.prompt_logprobs
        return piece | ({"degraded": list(chunk.degraded)} if chunk.degraded else {})

    def completion_logprobs(self, ids: list[int], entries: Sequence[TokenLogprob | None], *, echo: bool) -> dict:
        """OpenAI's completion logprobs of tokens in a row; echo: prompt tokens (which the text
        holds whole, special ones included), else generated ones (whose text leaves special
        tokens out)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(ids, entries):
            token = self.texts.text(token_id)
            tokens.append(token)
            offsets.append(self.text_offset)
            if echo or token_id not in self.texts.skipped:
                self.text_offset += self.texts.width(token_id)
            if entry is None:  # the first prompt token, or a chunk flagged logprobs_timeout
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(json_logprob(entry.logprob))
            top = {self.texts.text(i): json_logprob(v) for i, v in entry.top[:self.top_n]}
            top.setdefault(token, json_logprob(entry.logprob))
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def chat_piece(self, chunk: StreamChunk, *, delta: bool) -> dict:
        """The choice's part of a chat completion: `delta` (streaming) or `message`."""
        self.first_chunk(chunk)
        content = None
        if self.top_n is not None:
            content = [self.chat_logprob(i, e) for i, e in zip(chunk.token_ids.tolist(), chunk.logprobs or [])]
        message = {"content": chunk.text} if delta else {"role": "assistant", "content": chunk.text}
        piece = {"index": self.index, ("delta" if delta else "message"): message,
                 "logprobs": None if content is None else {"content": content}, "finish_reason": self.finish(chunk)}
        return piece | ({"degraded": list(chunk.degraded)} if chunk.degraded else {})

    def chat_logprob(self, token_id: int, entry: TokenLogprob) -> dict:
        raw, token = self.texts.get(token_id)
        top = []
        for top_id, value in entry.top[:self.top_n]:
            top_raw, top_token = self.texts.get(top_id)
            top.append({"token": top_token, "logprob": json_logprob(value), "bytes": list(top_raw)})
        return {"token": token, "logprob": json_logprob(entry.logprob), "bytes": list(raw), "top_logprobs": top}


def merge_pieces(kind: Literal["completion", "chat"], pieces: Sequence[dict]) -> dict:
    """One non-streamed choice from its pieces in order (a non-streamed request usually has one)."""
    merged = dict(pieces[-1])
    degraded = list(dict.fromkeys(reason for p in pieces for reason in p.get("degraded", ())))
    if degraded:
        merged["degraded"] = degraded
    if "prompt_logprobs" in pieces[0]:
        merged["prompt_logprobs"] = pieces[0]["prompt_logprobs"]
    if kind == "completion":
        merged["text"] = "".join(p["text"] for p in pieces)
        logprobs = [p["logprobs"] for p in pieces if p["logprobs"] is not None]
        if logprobs:
            merged["logprobs"] = {key: [v for lp in logprobs for v in lp[key]] for key in logprobs[0]}
        return merged
    merged["message"] = {"role": "assistant", "content": "".join(p["message"]["content"] for p in pieces)}
    contents = [p["logprobs"]["content"] for p in pieces if p["logprobs"] is not None]
    if contents:
        merged["logprobs"] = {"content": [entry for content in contents for entry in content]}
    return merged


def usage_json(choices: Sequence[Choice], n: int) -> dict:
    """OpenAI's usage summed over choices (each prompt counted once), nothing else in it: the draft
    tokens as OpenAI counts a prediction's, kept or refused (module docstring)."""
    usages = [(c.index, c.usage) for c in choices if c.usage is not None]
    prompt = sum(u.prompt_tokens for index, u in usages if index % n == 0)
    completion = sum(u.completion_tokens for _, u in usages)
    proposed = sum(u.draft_tokens_proposed for _, u in usages)
    accepted = sum(u.draft_tokens_accepted for _, u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "completion_tokens_details": {"accepted_prediction_tokens": accepted, "audio_tokens": 0,
                                          "reasoning_tokens": 0, "rejected_prediction_tokens": proposed - accepted}}


def speculation_json(choices: Sequence[Choice]) -> dict:
    """specbus's own counts, summed over choices: the top-level `speculation` next to `usage`."""
    usages = [c.usage for c in choices if c.usage is not None]
    proposed = sum(u.draft_tokens_proposed for u in usages)
    accepted = sum(u.draft_tokens_accepted for u in usages)
    lengths = [0] * max((len(u.speculative_lengths) for u in usages), default=0)
    for usage in usages:
        for k, count in enumerate(usage.speculative_lengths):
            lengths[k] += count
    return {"draft_tokens_proposed": proposed, "draft_tokens_accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0, "steps": sum(u.steps for u in usages),
            "speculative_lengths": lengths}


def vllm_prompt_logprobs(texts: TokenTexts, ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None,
                         top_n: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first, or one without logprobs) or
    {token id: {"logprob", "rank", "decoded_token"}} for the top-N and the prompt's own token (its
    rank as the verifier gave it; a top-N entry's is its place)."""
    out: list[dict | None] = []
    for token_id, entry in zip(ids, entries or [None] * len(ids)):
        if entry is None:
            out.append(None)
            continue
        top = {str(i): {"logprob": json_logprob(v), "rank": rank, "decoded_token": texts.text(i)}
               for rank, (i, v) in enumerate(entry.top[:top_n], start=1)}
        own = top.get(str(token_id), {}).get("rank")
        top.setdefault(str(token_id), {"logprob": json_logprob(entry.logprob), "rank": entry.rank or own,
                                       "decoded_token": texts.text(token_id)})
        out.append(top)
    return out


def response_id(kind: Literal["completion", "chat"]) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + secrets.token_hex(12)


@dataclass
class Envelope:
    """The fields every response and chunk of one request repeats."""

    kind: Literal["completion", "chat"]
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or response_id(self.kind)
        self.created = self.created or int(time.time())

    def wrap(self, choices: list[dict], *, chunk: bool, usage: dict | None = None,
             speculation: dict | None = None) -> dict:
        kind = "text_completion" if self.kind == "completion" else \
            ("chat.completion.chunk" if chunk else "chat.completion")
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        body |= {"usage": usage} if usage is not None or not chunk else {}
        return body | ({"speculation": speculation} if speculation is not None else {})


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


def model_card(served_name: str, target_dir: str | Path, draft_dir: str | Path, created: int) -> dict:
    """The entry of /v1/models: the OpenAI fields, then vLLM's root and max_model_len (added per
    answer: see VerifierLimits), then ours (the draft)."""
    return {"id": served_name, "object": "model", "created": created, "owned_by": "specbus",
            "root": Path(target_dir).name, "draft_model": Path(draft_dir).name}


@dataclass
class VerifierLimits:
    """max_model_len for /v1/models, as the verifiers advertise it in their heartbeats
    (model_ids["max_seq_len"]): the smallest among those heard within a few of their intervals
    (the scheduler refuses what the smallest cannot hold), None while none is heard."""

    beats: dict[str, tuple[int, float]] = field(default_factory=dict)  # instance -> (max_seq_len, expires)

    def observe(self, beat: Any, now: float) -> None:
        limit = str(beat.model_ids.get("max_seq_len", ""))
        if beat.role == "verifier" and limit.isdigit():
            self.beats[beat.instance_id] = (int(limit), now + HEARTBEATS_MISSED * beat.interval_s)

    def max_model_len(self, now: float) -> int | None:
        self.beats = {i: b for i, b in self.beats.items() if b[1] >= now}
        return min((limit for limit, _ in self.beats.values()), default=None)
