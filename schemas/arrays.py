"""Packed numpy arrays as pydantic field types.

On the wire an array is a msgpack map {"dtype": "int32"|"float16"|"float32", "shape": [..],
"data": <little-endian bytes>}; in Python it is a C-contiguous numpy array in native byte order.
Fields accept lists, numpy arrays or anything with `__array__` (a CPU torch tensor) and convert
them; an ndarray already of the right dtype is kept as is, not copied. Decoded arrays are fresh
writable copies, so `torch.from_numpy` works on them without warnings.

Field types (letters as in docs/PROTOCOL.md#encoding: n positions, N top entries, S support slots, R requested ids):
  TokenIds        int32 [n]     token ids, >= 0
  IdMatrix        int32 [n, S]  token ids, -1 marks padding
  ParentIndices   int32 [n]     indices of earlier nodes of a tree, -1 marks the root
  ProbMatrix      float16/32 [n, S]  probabilities, finite and >= 0
  LogprobVector   float32 [n]   log-probabilities, -inf allowed, NaN and +inf refused
  LogprobMatrix   float32 [n, N]
"""

import math
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic_core import PydanticCustomError, core_schema

MAX_ARRAY_BYTES = 64 * 1024 * 1024  # per array; the codec's message limit is usually lower
# The one padding id: an empty slot of an IdMatrix, of a row's draft ids, of a rejected position's
# token (never a vocabulary id, which is >= 0). Every tensor or array padding uses this name.
PAD_TOKEN_ID = -1
# The parent index of a tree node that hangs off the root, the row's last committed token
# (docs/PROTOCOL.md#tree-drafts); other nodes name an earlier node by its index, >= 0.
ROOT_PARENT = -1

WIRE_DTYPES = {"int32": np.dtype("<i4"), "float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
# The wire name of a native dtype, by lookup: numpy's `dtype.name` builds its string anew (a few
# times per message), a dict lookup does not. A non-native or other dtype is not here.
WIRE_NAMES = {dtype.newbyteorder("="): name for name, dtype in WIRE_DTYPES.items()}


def _fail(message: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError("packed_array", message, ctx or None)


@dataclass(frozen=True)
class Packed:
    """pydantic metadata: `Annotated[np.ndarray, Packed(("int32",), ndim=1, values="ids")]`.

    values: "ids" (>= 0), "padded_ids" (>= 0 or PAD_TOKEN_ID), "parents" (>= 0 or ROOT_PARENT),
    "probs" (finite, >= 0), "logprobs" (no NaN, no +inf), or None (no check).
    """

    dtypes: tuple[str, ...]
    ndim: int
    values: str | None = None

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            self.validate,
            serialization=core_schema.plain_serializer_function_ser_schema(self.serialize, info_arg=True),
        )

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict:
        return {"type": "object", "description": f"packed {'|'.join(self.dtypes)} array, ndim {self.ndim}"}

    def validate(self, value: Any) -> np.ndarray:
        if isinstance(value, dict):
            array = self._from_wire(value)
        elif isinstance(value, (list, tuple, np.ndarray)) or hasattr(value, "__array__"):
            array = self._from_python(_as_numpy(value))
        else:
            raise _fail("expected an array (list, numpy array or packed map), got {kind}", kind=type(value).__name__)
        if array.ndim != self.ndim:
            raise _fail("expected {ndim}-D array, got shape {shape}", ndim=self.ndim, shape=str(array.shape))
        self._check_values(array)
        return array

    def serialize(self, array: np.ndarray, info: Any) -> Any:
        if info.mode_is_json():
            return array.tolist()
        name = WIRE_NAMES.get(array.dtype) or array.dtype.name
        data = array.astype(WIRE_DTYPES[name], copy=False).tobytes()
        return {"dtype": name, "shape": list(array.shape), "data": data}

    def _from_wire(self, value: dict) -> np.ndarray:
        if len(value) != 3 or not {"dtype", "shape", "data"} <= value.keys():
            raise _fail("packed array needs exactly the keys dtype, shape, data; got {keys}",
                        keys=sorted(map(str, value)))
        name, shape, data = value["dtype"], value["shape"], value["data"]
        if name not in self.dtypes:
            raise _fail("dtype '{dtype}' not allowed here (allowed: {allowed})",
                        dtype=str(name), allowed=", ".join(self.dtypes))
        if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0 for d in shape):
            raise _fail("shape must be a list of non-negative integers")
        if len(shape) != self.ndim:
            raise _fail("expected {ndim}-D array, got shape {shape}", ndim=self.ndim, shape=str(list(shape)))
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise _fail("data must be bytes")
        wire = WIRE_DTYPES[name]
        expected = math.prod(shape) * wire.itemsize
        if expected > MAX_ARRAY_BYTES:
            raise _fail("array of {size} bytes exceeds the {limit} byte limit", size=expected, limit=MAX_ARRAY_BYTES)
        if len(data) != expected:
            raise _fail("shape {shape} needs {expected} bytes of {dtype}, got {got}",
                        shape=str(list(shape)), expected=expected, dtype=name, got=len(data))
        # astype copies: a writable array in native byte order, detached from the message buffer
        return np.frombuffer(data, dtype=wire).reshape(shape).astype(name)

    def _from_python(self, array: np.ndarray) -> np.ndarray:
        if array.size == 0 and array.ndim != self.ndim:
            array = array.reshape((0,) * self.ndim)
        if array.nbytes > MAX_ARRAY_BYTES:
            raise _fail("array of {size} bytes exceeds the {limit} byte limit",
                        size=array.nbytes, limit=MAX_ARRAY_BYTES)
        if WIRE_NAMES.get(array.dtype) in self.dtypes:
            return np.ascontiguousarray(array)
        if self.dtypes == ("int32",):
            if array.size == 0:
                return np.zeros(array.shape, np.int32)
            if array.dtype.kind not in "iu":
                raise _fail("expected integers, got dtype {dtype}", dtype=array.dtype.name)
            if array.min() < -(2**31) or array.max() >= 2**31:
                raise _fail("integers do not fit in int32")
            return np.ascontiguousarray(array, dtype=np.int32)
        if array.dtype.kind not in "fiu":
            raise _fail("expected numbers, got dtype {dtype}", dtype=array.dtype.name)
        # float64 and friends narrow to the widest float dtype this field allows
        return np.ascontiguousarray(array, dtype=self.dtypes[-1])

    def _check_values(self, array: np.ndarray) -> None:
        if array.size == 0 or self.values is None:
            return
        if self.values == "ids" and array.min() < 0:
            raise _fail("token ids must be >= 0, got {value}", value=int(array.min()))
        if self.values == "padded_ids" and array.min() < PAD_TOKEN_ID:
            raise _fail(f"token ids must be >= 0 (or {PAD_TOKEN_ID} for padding), got {{value}}",
                        value=int(array.min()))
        if self.values == "parents" and array.min() < ROOT_PARENT:
            raise _fail(f"parent indices must be >= 0 (or {ROOT_PARENT} for the root), got {{value}}",
                        value=int(array.min()))
        # `x < inf` is False for NaN and +inf: one pass instead of isnan + isposinf
        if self.values == "probs" and not ((array >= 0) & (array < np.inf)).all():
            raise _fail("probabilities must be finite and >= 0")
        if self.values == "logprobs" and not (array < np.inf).all():
            raise _fail("logprobs must not be NaN or +inf")

TokenIds = Annotated[np.ndarray, Packed(("int32",), ndim=1, values="ids")]
IdMatrix = Annotated[np.ndarray, Packed(("int32",), ndim=2, values="padded_ids")]
# [n]: node i's parent in a tree of draft tokens, an earlier node's index or ROOT_PARENT
ParentIndices = Annotated[np.ndarray, Packed(("int32",), ndim=1, values="parents")]
ProbMatrix = Annotated[np.ndarray, Packed(("float16", "float32"), ndim=2, values="probs")]
LogprobVector = Annotated[np.ndarray, Packed(("float32",), ndim=1, values="logprobs")]
LogprobMatrix = Annotated[np.ndarray, Packed(("float32",), ndim=2, values="logprobs")]


Ranks = TokenIds  # int32 [n], 1 = most likely


def empty_ids() -> np.ndarray:
    return np.zeros(0, np.int32)


def empty_logprobs() -> np.ndarray:
    return np.zeros(0, np.float32)


def _as_numpy(value: Any) -> np.ndarray:
    try:
        return np.asarray(value)
    except ValueError as exc:  # ragged nested lists
        raise _fail("not a rectangular array: {reason}", reason=str(exc)) from None


def same_value(a: Any, b: Any) -> bool:
    """Equality that treats numpy arrays as values (dtype, shape and elements), recursively."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b
