"""msgpack codec: typed models <-> bytes.

decode() refuses, in this order and each with a typed CodecError: a payload over max_bytes
(before unpacking), bytes that are not one msgpack map (malformed), a protocol version outside
this process's window (unsupported_version, field "v"; schemas/bus/versions.py), a `type` other than the expected one
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
from schemas.steps import DraftRequest, DraftResponse, VerifyRequest, VerifyResponse
from schemas.streams import Admitted, StreamChunk
from schemas.bus.versions import REHEARSAL_KEY, REHEARSAL_VERSION, WINDOW, Window
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


def encode(message: Message, v: int | None = None) -> bytes:
    """The message in version v (default message.v): the version its receivers speak."""
    raw = message.model_dump()
    if v is not None:
        raw["v"] = v
    if raw["v"] == REHEARSAL_VERSION:
        raw[REHEARSAL_KEY] = True
    try:
        return msgpack.packb(raw, use_bin_type=True)
    except (TypeError, ValueError, PydanticSerializationError) as exc:
        raise CodecError(ErrorCode.internal, f"cannot encode {type(message).__name__}: {exc}") from exc


def encode_beats(heartbeat: Heartbeat, window: Window = WINDOW) -> list[bytes]:
    """A heartbeat once per version of the window: every listener finds a copy it speaks."""
    return [encode(heartbeat, v) for v in window.versions()]


def decode(data: bytes, message_type: type[M], *, max_bytes: int = MAX_MESSAGE_BYTES,
           context: dict[str, Any] | None = None, window: Window = WINDOW) -> M:
    """context is passed to validation, e.g. {"max_tokens_cap": 8192} for a scheduler's cap;
    window: the versions accepted (this process's)."""
    raw = _unpack(data, max_bytes, window)
    expected = message_type.model_fields["type"].default
    if raw["type"] != expected:
        raise CodecError(ErrorCode.wrong_message_type, f"expected a {expected!r} message, got {raw['type']!r}", "type")
    return validate(message_type, raw, context)


def decode_heartbeat(data: bytes, window: Window = WINDOW) -> Heartbeat | None:
    """The heartbeat, or None for a copy addressed to other versions (encode_beats): one in a
    version outside the window from a sender that also speaks one inside it, or one inside it
    that is not the copy Window.keeps. A beat nobody here can read raises, as decode does."""
    try:
        beat = decode(data, Heartbeat, window=window)
    except CodecError as exc:
        if exc.code == ErrorCode.unsupported_version and _also_sent_for(data, window):
            return None
        raise
    return beat if window.keeps(beat.v, beat.protocol_version) else None


def _also_sent_for(data: bytes, window: Window) -> bool:
    """Whether the beat is a copy for another version: sent in a version of its sender's window,
    by a sender that speaks a version of this window too (so it sent a copy in it). A beat whose
    version lies outside the window it claims is no copy: the caller's error stands."""
    try:
        raw = msgpack.unpackb(data, raw=False)
        low, high, v = raw.get("protocol_min"), raw.get("protocol_version"), raw.get("v")
    except Exception:  # any garbage: not a copy, the caller's error stands
        return False
    if not all(type(n) is int for n in (low, high, v)):
        return False
    return low <= v <= high and low <= window.high and window.low <= high


def decode_any(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES, context: dict[str, Any] | None = None,
               window: Window = WINDOW) -> Message:
    raw = _unpack(data, max_bytes, window)
    message_type = MESSAGE_TYPES.get(raw["type"])
    if message_type is None:
        raise CodecError(ErrorCode.wrong_message_type, f"unknown message type {raw['type']!r}", "type")
    return validate(message_type, raw, context)


def error_reply(error: SpecbusError | BaseException | ErrorCode | str, message: str = "", field: str | None = None,
                request_id: str | None = None, v: int | None = None) -> bytes:
    """Encoded Error for a reply: from an exception (see Error.from_exception) or from a code;
    in version v (the request's: reply_version)."""
    if isinstance(error, BaseException):
        reply = Error.from_exception(error, request_id)
    else:
        reply = Error(code=error, message=message, field=field, request_id=request_id)
    return encode(reply, v)


def reply_version(data: bytes, window: Window = WINDOW) -> int:
    """The version to answer a message in: its own when this window speaks it, else (a refused
    message) the low end, the version a peer of a rolling upgrade is likeliest to read."""
    try:
        v = msgpack.unpackb(data, raw=False).get("v")
    except Exception:  # not one msgpack map: it was refused for that
        return window.low
    return v if window.speaks(v) else window.low


def _unpack(data: bytes, max_bytes: int, window: Window) -> dict:
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
    if not window.speaks(raw.get("v")):
        raise CodecError(ErrorCode.unsupported_version, f"protocol version {raw.get('v')!r} not supported "
                         f"(this side speaks {window.low} to {window.high})", "v")
    if raw["v"] == REHEARSAL_VERSION and raw.pop(REHEARSAL_KEY, None) is not True:
        raise CodecError(ErrorCode.invalid_field, f"a version {REHEARSAL_VERSION} message must carry "
                         f"{REHEARSAL_KEY!r}: true", REHEARSAL_KEY)
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
