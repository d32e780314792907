"""Error codes carried on the wire and the typed exception every specbus layer raises."""

from enum import Enum


class ErrorCode(str, Enum):
    bad_request = "bad_request"  # the request makes no sense as a whole
    invalid_field = "invalid_field"  # one field fails validation; `field` names it
    unsupported_version = "unsupported_version"  # protocol version `v` not spoken here
    wrong_message_type = "wrong_message_type"  # a valid message, but not the one expected
    malformed = "malformed"  # not msgpack, truncated, or not a map
    too_large = "too_large"  # payload over the size limit, refused before unpacking
    overloaded = "overloaded"  # admission queue full
    timeout = "timeout"  # a deadline passed: the request's, a batch's (field "deadline") or a wait's
    cancelled = "cancelled"  # the request was cancelled
    not_found = "not_found"  # unknown request id or instance
    duplicate_request_id = "duplicate_request_id"  # the request_id is running, queued or finished moments ago
    need_resync = "need_resync"  # receiver's cached state differs from what the sender expects
    no_capacity = "no_capacity"  # no live instance able to take the work
    unavailable = "unavailable"  # no responders / instance gone
    shutting_down = "shutting_down"  # the scheduler is stopping: resend the request (the client library does)
    forbidden = "forbidden"  # the NATS server refused this user a publish or subscription
    internal = "internal"  # unexpected failure; details are in the server log, not the reply


class SpecbusError(Exception):
    """An error with a wire code, a readable message and, when one is to blame, the field.

    `field` is a dotted path into the message, e.g. "sampling.top_p" or "rows[3].draft_token_ids".
    """

    def __init__(self, code: ErrorCode | str, message: str, field: str | None = None):
        self.code = ErrorCode(code)
        self.message = message
        self.field = field
        super().__init__(f"{self.code.value}: {field}: {message}" if field else f"{self.code.value}: {message}")


class CodecError(SpecbusError):
    """Bytes that cannot be decoded into the expected message."""
