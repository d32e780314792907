"""OpenAI error objects: ApiError ({"error": {"message", "type", "param", "code"}} with its
HTTP status), what a specbus error, a body pydantic refused and the web framework's own refusals
become. Every error names the body's full path to the field it is about (`messages[0].content`,
`stop[1]`), as the body spells it; what it echoes of an input is clipped.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from schemas.bus.codec import field_path
from schemas.errors import ErrorCode, SpecbusError
from services.client_requests import GROUPS

# An input echoed in an error message is cut to this many characters (an 8 MB model name must not
# come back whole); a whole message and its param are cut too, whatever they hold.
MAX_ECHO_CHARS = 64
MAX_MESSAGE_CHARS = 1024
MAX_PARAM_CHARS = 128

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
        """The OpenAI error for a specbus error; its field becomes the body's full path to it
        (`body_path`: "sampling.stop[1]" -> "stop[1]", "messages[0].content" as it is)."""
        status, kind = STATUS_OF_CODE.get(exc.code, (500, "server_error"))  # a code newer than this table
        param = body_path(exc.field, param_names) if exc.field else None
        return cls(status, f"{param}: {exc.message}" if param else exc.message, type=kind, param=param,
                   code=exc.code.value)


def body_path(field: str, param_names: Mapping[str, str] = {}) -> str:
    """A GenerateRequest field path as the body spells it: the option group (sampling, logprobs,
    speculative: the body's fields are flat) left out, the first name renamed by param_names
    (specbus option -> body field, e.g. logprobs -> top_logprobs), indexes and subfields kept."""
    group, _, rest = field.partition(".")
    if group in GROUPS and rest:
        field = rest
    name = re.match(r"[^.\[]*", field).group()
    return param_names.get(name, name) + field[len(name):]


def is_body_field(part: str | int) -> bool:
    """Whether a part of pydantic's error location names a body field or a list index (its
    union-member tags, "str", "int", ..., and function names do not)."""
    return isinstance(part, int) or (re.fullmatch(r"[a-z_][a-z0-9_]*", str(part)) is not None
                                     and part not in ("str", "int", "float", "bool"))


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """A 400 for pydantic's (FastAPI's) validation errors: the first, its location as param
    ("messages[0].role"; "body" and pydantic's union-member tags left out). A body that is not
    JSON is FastAPI's `json_invalid` error, located at a character position, not a field; an
    empty body is `invalid_json` too."""
    first = errors[0]
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return ApiError(400, "the body is empty: send a JSON object", code="invalid_json")
    if first.get("type") == "json_invalid":
        where = first.get("loc", ())[1:]
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        at = f" at character {where[0]}" if where and isinstance(where[0], int) else ""
        return ApiError(400, f"the body is not valid JSON: {detail}{at}", code="invalid_json")
    path = field_path(tuple(itertools.takewhile(is_body_field, first.get("loc", ())[1:])))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"{clip(path)}: {message}" if path else message, param=path or None,
                    code="invalid_field" if path else "bad_request")


# The errors the web framework answers by itself (Starlette's HTTPException), as OpenAI errors.
FRAMEWORK_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}


def framework_error(status: int, method: str, path: str, allowed: str | None = None,
                    cause: BaseException | None = None) -> ApiError:
    """The OpenAI error for what Starlette refuses before a handler runs: an unknown route (404),
    a method the route does not take (405), a body it cannot parse (400 invalid_json, saying why:
    `unreadable_json`; cause: the exception the parser raised)."""
    route = f"{method} {clip(path)}"
    if status == 404:
        message = f"no such route: {route}"
    elif status == 405:
        message = f"method not allowed: {route}" + (f" (allowed: {allowed})" if allowed else "")
    elif status == 400:
        message = unreadable_json(cause)
    else:
        message = f"{route}: HTTP {status}"
    kind = "server_error" if status >= 500 else ("not_found_error" if status == 404 else "invalid_request_error")
    return ApiError(status, message, type=kind, code=FRAMEWORK_CODES.get(status, f"http_{status}"))


def unreadable_json(cause: BaseException | None) -> str:
    """Why a body that is not a JSON syntax error could not be parsed: not UTF-8, nested deeper
    than the parser goes, or a number longer than Python converts."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid JSON: it must be UTF-8 encoded ({cause.reason} at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "the body cannot be read as JSON: it is nested too deeply"
    if isinstance(cause, ValueError):
        return f"the body cannot be read as JSON: {str(cause).split(';')[0]}"
    return "the body is not valid JSON"


def content_type_error(content_type: str | None) -> ApiError | None:
    """A 415 for a body sent as something other than JSON (None: no Content-Type, read as JSON,
    or application/json, or a +json type)."""
    if content_type is None:
        return None
    media = content_type.split(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return None
    return ApiError(415, f"the body must be JSON, sent with Content-Type: application/json (got {clip(media)!r})",
                    code="unsupported_media_type")
