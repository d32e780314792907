"""The Error reply (schemas/bus/wire.py): built from an exception, it round-trips."""

from schemas import Error, ErrorCode, SpecbusError, decode, encode


def test_error_from_exception():
    error = Error.from_exception(SpecbusError("overloaded", "queue full"), request_id="r1")
    assert (error.code, error.message, error.request_id) == (ErrorCode.overloaded, "queue full", "r1")
    assert decode(encode(error), Error) == error
