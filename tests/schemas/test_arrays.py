"""Packed arrays: little-endian bytes with the dtype named, validated on the way in."""

import msgpack
import numpy as np
import pytest

from schemas import (MAX_ARRAY_BYTES, PROTOCOL_VERSION, CodecError, ErrorCode, GenerateRequest, LogprobArrays, Proposal,
                     StreamChunk, TokenLogprob, decode)


def prompt_ids_payload(packed) -> bytes:
    """A GenerateRequest whose prompt_token_ids field carries `packed` as is."""
    raw = {"v": PROTOCOL_VERSION, "type": "generate", "request_id": "r", "prompt_token_ids": packed}
    return msgpack.packb(raw, use_bin_type=True)


def test_int32_bytes_are_little_endian():
    raw = StreamChunk(request_id="r", seq=0, token_ids=[1, 258], from_draft=[False, True]).model_dump()
    assert raw["token_ids"] == {"dtype": "int32", "shape": [2], "data": b"\x01\x00\x00\x00\x02\x01\x00\x00"}


def test_float_bytes_are_little_endian():
    half = Proposal(kind="dense", probs=np.array([[1.0, 0.5]], np.float16), draft_vocab_size=2).model_dump()["probs"]
    single = Proposal(kind="dense", probs=np.array([[1.0, 0.5]], np.float32), draft_vocab_size=2).model_dump()["probs"]
    assert half == {"dtype": "float16", "shape": [1, 2], "data": b"\x00\x3c\x00\x38"}
    assert single == {"dtype": "float32", "shape": [1, 2], "data": b"\x00\x00\x80\x3f\x00\x00\x00\x3f"}


def test_big_endian_input_is_converted():
    chunk = StreamChunk(request_id="r", seq=0, token_ids=np.array([1, 258], ">i4"), from_draft=[False, False])
    assert chunk.token_ids.dtype == np.int32 and chunk.token_ids.dtype.isnative
    assert chunk.model_dump()["token_ids"]["data"] == b"\x01\x00\x00\x00\x02\x01\x00\x00"


def test_wire_bytes_decode_to_a_writable_array():
    packed = {"dtype": "int32", "shape": [2], "data": b"\x07\x00\x00\x00\x00\x01\x00\x00"}
    ids = decode(prompt_ids_payload(packed), GenerateRequest).prompt_token_ids
    np.testing.assert_array_equal(ids, [7, 256])
    ids[0] = 9  # the verifier hands these to torch.from_numpy, which warns on read-only memory
    assert ids[0] == 9


def test_python_inputs_are_converted():
    from_int64 = GenerateRequest(request_id="r", prompt_token_ids=np.array([3, 4], np.int64))
    from_tuple = GenerateRequest(request_id="r", prompt_token_ids=(3, 4))
    assert from_int64 == from_tuple
    assert from_int64.prompt_token_ids.dtype == np.int32
    logprobs = TokenLogprob(token_id=3, logprob=-1.0, top_ids=[3], top_logprobs=np.array([-1.0], np.float64))
    assert logprobs.top_logprobs.dtype == np.float32


@pytest.mark.parametrize("packed, message", [
    ({"dtype": "int32", "shape": [3], "data": b"\x00" * 8}, r"shape \[3\] needs 12 bytes of int32, got 8"),
    ({"dtype": "int32", "shape": [2, 1], "data": b"\x00" * 8}, "expected 1-D array"),
    ({"dtype": "int64", "shape": [1], "data": b"\x00" * 8}, "dtype 'int64' not allowed here"),
    ({"dtype": "float32", "shape": [1], "data": b"\x00" * 4}, "dtype 'float32' not allowed here"),
    ({"dtype": "int32", "shape": [-1], "data": b""}, "non-negative integers"),
    ({"dtype": "int32", "shape": [1], "data": "abcd"}, "data must be bytes"),
    ({"dtype": "int32", "shape": [1]}, "exactly the keys dtype, shape, data"),
    ({"dtype": "int32", "shape": [1 << 30], "data": b""}, f"exceeds the {MAX_ARRAY_BYTES} byte limit"),
    ({"dtype": "int32", "shape": [1], "data": b"\xff\xff\xff\xff"}, "token ids must be >= 0"),
    ("1,2,3", "expected an array"),
    ([[1, 2], [3]], "not a rectangular array"),
    ([2**31], "do not fit in int32"),
    ([True], "expected integers"),
])
def test_bad_packed_array_is_refused_naming_the_field(packed, message):
    with pytest.raises(CodecError, match=message) as caught:
        decode(prompt_ids_payload(packed), GenerateRequest)
    assert (caught.value.code, caught.value.field) == (ErrorCode.invalid_field, "prompt_token_ids")


def test_probabilities_must_be_finite_and_non_negative():
    with pytest.raises(ValueError, match="probabilities must be finite and >= 0"):
        Proposal(kind="dense", probs=[[0.5, np.nan]], draft_vocab_size=2)
    with pytest.raises(ValueError, match="probabilities must be finite and >= 0"):
        Proposal(kind="dense", probs=[[1.5, -0.5]], draft_vocab_size=2)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_logprob_arrays_allow_minus_inf_but_not_nan_or_plus_inf(bad):
    no_columns = np.zeros((1, 0))
    fine = LogprobArrays(token_logprobs=[-np.inf], top_ids=no_columns.astype(np.int32), top_logprobs=no_columns,
                         requested_logprobs=no_columns)
    assert np.isneginf(fine.token_logprobs[0])
    with pytest.raises(ValueError, match="must not be NaN or \\+inf"):
        LogprobArrays(token_logprobs=[bad], top_ids=no_columns.astype(np.int32), top_logprobs=no_columns,
                      requested_logprobs=no_columns)


def test_equality_compares_array_values_and_dtypes():
    """The round-trip tests rely on this: a changed element or dtype must make messages unequal."""
    def proposal(probs):
        return Proposal(kind="dense", probs=probs, draft_vocab_size=2)

    assert proposal(np.array([[0.5, 0.5]], np.float32)) == proposal(np.array([[0.5, 0.5]], np.float32))
    assert proposal(np.array([[0.5, 0.5]], np.float32)) != proposal(np.array([[0.5, 0.25]], np.float32))
    assert proposal(np.array([[0.5, 0.5]], np.float32)) != proposal(np.array([[0.5, 0.5]], np.float16))
    assert StreamChunk(request_id="r", seq=0, token_ids=[1], from_draft=[True]) != \
        StreamChunk(request_id="r", seq=0, token_ids=[1], from_draft=[False])


def test_json_dump_gives_plain_lists():
    chunk = StreamChunk(request_id="r", seq=0, token_ids=[5, 6], from_draft=[True, False])
    assert chunk.model_dump(mode="json")["token_ids"] == [5, 6]
