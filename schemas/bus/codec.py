"""msgpack codec: typed models <-> bytes.

decode() refuses, in this order and each with a typed CodecError: a payload over max_bytes
(before unpacking), bytes that are not one msgpack map (malformed), a protocol version other
than ours (unsupported_version, field "v"), a `type` other than the expected one
(wrong_message_type, field "type"), and any failed field (invalid_field, with the dotted path
of the first error, e.g. "rows[3].draft_token_ids").
"""

from typing import Any, TypeVar

import msgpack
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from schemas.commits import Commit, SideChannelRecord, StopNotice
from schemas.config import MAX_MESSAGE_BYTES
from schemas.bus.control import Heartbeat
from schemas.errors import CodecError, ErrorCode, SpecbusError
from schemas.generation import CancelRequest, GenerateRequest
from schemas.bus.protocol import PROTOCOL_VERSION
from schemas.steps import DraftRequest, DraftResponse, VerifyRequest, VerifyResponse
from schemas.streams import Admitted, StreamChunk
from schemas.bus.wire import Error, Message

# Every top-level message by its `type` string: what decode_any accepts.
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.model_fields["type"].default: cls
    for cls in (GenerateRequest, CancelRequest, Error, StreamChunk, Admitted, DraftRequest, DraftResponse,
                VerifyRequest, VerifyResponse, SideChannelRecord, Commit, StopNotice, Heartbeat)
}
# Containers in our messages are small (arrays are packed bytes), so tight per-container limits
# cost nothing and stop a hostile payload from ballooning into millions of Python objects.
MAX_ARRAY_LEN = 1 << 17
MAX_MAP_LEN = 1 << 10

M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    try:
        return msgpack.packb(message.model_dump(), use_bin_type=True)
    except (TypeError, ValueError, PydanticSerializationError) as exc:
        raise CodecError(ErrorCode.internal, f"cannot encode {type(message).__name__}: {exc}") from exc


def decode(data: bytes, message_type: type[M], *, max_bytes: int = MAX_MESSAGE_BYTES,
           context: dict[str, Any] | None = None) -> M:
    """context is passed to validation, e.g. {"max_tokens_cap": 8192} for a scheduler's cap."""
    raw = _unpack(data, max_bytes)
    expected = message_type.model_fields["type"].default
    if raw["type"] != expected:
        raise CodecError(ErrorCode.wrong_message_type, f"expected a {expected!r} message, got {raw['type']!r}", "type")
    return validate(message_type, raw, context)


def decode_any(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES, context: dict[str, Any] | None = None) -> Message:
    raw = _unpack(data, max_bytes)
    message_type = MESSAGE_TYPES.get(raw["type"])
    if message_type is None:
        raise CodecError(ErrorCode.wrong_message_type, f"unknown message type {raw['type']!r}", "type")
    return validate(message_type, raw, context)


def error_reply(error: SpecbusError | BaseException | ErrorCode | str, message: str = "", field: str | None = None,
                request_id: str | None = None) -> bytes:
    """Encoded Error for a reply: from an exception (see Error.from_exception) or from a code."""
    if isinstance(error, BaseException):
        reply = Error.from_exception(error, request_id)
    else:
        reply = Error(code=error, message=message, field=field, request_id=request_id)
    return encode(reply)


def _unpack(data: bytes, max_bytes: int) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(ErrorCode.malformed, f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise CodecError(ErrorCode.too_large, f"payload of {len(data)} bytes exceeds the {max_bytes} byte limit")
    try:
        raw = msgpack.unpackb(data, raw=False, max_bin_len=max_bytes,
                              max_str_len=max_bytes, max_array_len=MAX_ARRAY_LEN, max_map_len=MAX_MAP_LEN,
                              max_ext_len=0)
    except ValueError as exc:  # every msgpack unpack failure (ExtraData, FormatError, StackError...)
        raise CodecError(ErrorCode.malformed, f"not a valid msgpack message: {unpack_failure(exc)}") from exc
    if not isinstance(raw, dict):
        raise CodecError(ErrorCode.malformed, f"expected a msgpack map, got {type(raw).__name__}")
    if raw.get("v") != PROTOCOL_VERSION or type(raw.get("v")) is not int:
        raise CodecError(ErrorCode.unsupported_version,
                         f"protocol version {raw.get('v')!r} not supported (this side speaks {PROTOCOL_VERSION})", "v")
    if not isinstance(raw.get("type"), str):
        raise CodecError(ErrorCode.wrong_message_type, "message has no type", "type")
    return raw


def unpack_failure(exc: ValueError) -> str:
    """What was wrong, never empty: msgpack raises some errors (StackError: nesting deeper than
    its limit) with no text at all."""
    if isinstance(exc, msgpack.StackError):
        return "containers are nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return f"a string is not valid UTF-8 ({exc.reason} at byte {exc.start})"
    return str(exc) or type(exc).__name__


def validate(message_type: type[M], raw: dict, context: dict[str, Any] | None = None) -> M:
    """model_validate, with a failure as CodecError(invalid_field) naming the first bad field."""
    try:
        return message_type.model_validate(raw, context=context)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        path = field_path(first["loc"], (first.get("ctx") or {}).get("field"))
        code = ErrorCode.unsupported_version if first["type"] == "unsupported_version" else ErrorCode.invalid_field
        raise CodecError(code, first["msg"], path or None) from None


def field_path(loc: tuple, extra: str | None = None) -> str:
    """('rows', 3, 'proposal') + 'probs' -> 'rows[3].proposal.probs'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    if extra:
        path += f".{extra}" if path else extra
    return path
