"""The base of every model on the bus, the field types they share, and the Error reply.

Each top-level message (a `Message`) carries `v` (the version it is sent in, schemas/bus/versions.py)
and a `type` string;
sub-models (a `WireModel`) carry neither. Token ids and probability/logprob vectors are packed
numpy arrays (schemas/arrays.py). Rows are always keyed by `request_id`, never by position.

A check that involves several fields raises `field_error(path, message)`: the codec appends
`path` to the error's location, so the client sees e.g. `rows[2].proposal.probs`.
"""

import math
from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic_core import PydanticCustomError

from schemas.arrays import Packed, same_value
from schemas.errors import ErrorCode, SpecbusError
from schemas.bus.protocol import PROTOCOL_MIN
from schemas.bus.versions import REHEARSAL_VERSION, WINDOW
from schemas.bus.subjects import INSTANCE_ID_PATTERN

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


class WireModel(BaseModel):
    """Base of every model: strict fields, and equality that compares arrays by value."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(same_value(getattr(self, name), getattr(other, name)) for name in type(self).model_fields)

    __hash__ = None


class Message(WireModel):
    # the version it is (to be) sent in: the low end of this process's window unless set (docs/PROTOCOL.md#version-rule)
    v: int = WINDOW.low

    @field_validator("v")
    @classmethod
    def _known_version(cls, v: int) -> int:
        # which of these a process accepts is its window's business (codec.decode)
        if not PROTOCOL_MIN <= v <= REHEARSAL_VERSION:
            raise PydanticCustomError("unsupported_version",
                                      "protocol version {v} not supported (this code knows {low} to {high})",
                                      {"v": v, "low": PROTOCOL_MIN, "high": REHEARSAL_VERSION})
        return v


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
