"""Codec: every message survives encode -> decode; bad bytes give a typed CodecError."""

import re
import string

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from schemas import (DEGRADED_REASONS, MESSAGE_TYPES, PROTOCOL_VERSION, Admitted, CancelRequest, CodecError, Commit,
                     DraftRequest, DraftResponse, DraftResult, DraftRow, Error, ErrorCode, FeatureBlock,
                     GenerateRequest, Heartbeat, LogprobArrays, LogprobOptions, Proposal, RowSampling, SamplingMask,
                     SamplingParams, SideChannelRecord, SpecbusError, SpeculativeOptions, StopNotice, StreamChunk,
                     TokenLogprob, Usage, VerifyRequest, VerifyResponse, VerifyResult, VerifyRow, decode, decode_any,
                     encode, error_reply)

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

request_ids = st.text(string.ascii_letters + string.digits + "_.:-", min_size=1, max_size=128)
instance_ids = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=64)
counts = st.integers(0, 2**40)
small = st.integers(0, 4)
texts = st.text(max_size=12)
logprob_values = st.floats(max_value=0.0, width=32, allow_nan=False)  # -inf included


def token_ids(min_size=0, max_size=6):
    return hnp.arrays(np.int32, st.integers(min_size, max_size), elements=st.integers(0, 2**31 - 1))


def logprob_arrays(shape):
    return hnp.arrays(np.float32, shape, elements=logprob_values)


@st.composite
def prob_arrays(draw, shape):
    dtype = draw(st.sampled_from([np.float16, np.float32]))
    width = 16 if dtype == np.float16 else 32
    return draw(hnp.arrays(dtype, shape, elements=st.floats(0, 1, width=width)))


row_sampling_fields = dict(
    temperature=st.just(0.0) | st.floats(0.01, 100), top_k=st.integers(0, 1000), top_p=st.floats(1e-6, 1),
    min_p=st.floats(0, 1, exclude_max=True), seed=st.none() | st.integers(0, 2**63 - 1))
row_samplings = st.builds(RowSampling, **row_sampling_fields)
sampling_params = st.builds(SamplingParams, **row_sampling_fields, max_tokens=st.integers(0, 4096),
                            stop_token_ids=token_ids(), stop=st.lists(st.text(min_size=1, max_size=8), max_size=3),
                            ignore_eos=st.booleans())
logprob_options = st.builds(LogprobOptions, logprobs=st.none() | st.integers(0, 20),
                            prompt_logprobs=st.none() | st.integers(0, 20),
                            logprobs_mode=st.sampled_from(["raw", "processed"]), logprob_token_ids=token_ids(),
                            sampling_mask=st.booleans(), max_mask_size=st.integers(1, 1 << 20))
errors = st.builds(Error, code=st.sampled_from(list(ErrorCode)), message=texts, field=st.none() | texts,
                   request_id=st.none() | texts)
usages = st.builds(Usage, prompt_tokens=counts, completion_tokens=counts, draft_tokens_proposed=counts,
                   draft_tokens_accepted=counts, acceptance_rate=st.floats(0, 1), steps=counts,
                   degraded_steps=st.dictionaries(st.sampled_from(DEGRADED_REASONS), counts))
degraded = st.lists(st.sampled_from(DEGRADED_REASONS), max_size=2)
finish_reasons = st.none() | st.sampled_from(["length", "stop", "eos", "cancelled", "timeout", "error"])
deadlines = st.floats(1.0, 1e10)


@st.composite
def generate_requests(draw):
    prompt = draw(st.text(min_size=1, max_size=20)) if draw(st.booleans()) else None
    return GenerateRequest(
        request_id=draw(request_ids), prompt=prompt,
        prompt_token_ids=draw(token_ids(min_size=1)) if prompt is None else None,
        sampling=draw(sampling_params), logprobs=draw(logprob_options),
        speculative=draw(st.builds(SpeculativeOptions, num_speculative_tokens=st.integers(0, 16),
                                   draft_mode=st.sampled_from(["greedy", "sample"]))),
        timeout_s=draw(st.floats(0.001, 3600)), stream=draw(st.booleans()))


@st.composite
def sampling_masks(draw):
    if draw(st.booleans()):
        return SamplingMask(all_tokens=True, size=draw(counts))
    ids = sorted(draw(st.lists(st.integers(0, 2**31 - 1), unique=True, max_size=6)))
    return SamplingMask(token_ids=ids, size=len(ids) + draw(small))


@st.composite
def token_logprobs(draw):
    num_top = draw(small)
    return TokenLogprob(token_id=draw(st.integers(0, 2**31 - 1)), logprob=draw(logprob_values),
                        rank=draw(st.none() | st.integers(1, 2**31)), token=draw(st.none() | texts),
                        top_ids=draw(token_ids(num_top, num_top)), top_logprobs=draw(logprob_arrays(num_top)),
                        requested_logprobs=draw(logprob_arrays(draw(small))))


@st.composite
def stream_chunks(draw):
    n = draw(small)
    prompt_ids = draw(st.none() | token_ids(min_size=1))
    num_prompt = draw(small) if prompt_ids is None else len(prompt_ids)
    return StreamChunk(
        request_id=draw(request_ids), seq=draw(counts), token_ids=draw(token_ids(n, n)), text=draw(texts),
        from_draft=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        logprobs=draw(st.none() | st.lists(token_logprobs(), min_size=n, max_size=n)),
        sampling_masks=draw(st.none() | st.lists(sampling_masks(), min_size=n, max_size=n)),
        degraded=draw(degraded), finish_reason=draw(finish_reasons), usage=draw(st.none() | usages),
        prompt_token_ids=prompt_ids,
        prompt_logprobs=draw(st.none() | st.lists(st.none() | token_logprobs(), min_size=num_prompt,
                                                  max_size=num_prompt)),
        error=draw(st.none() | errors))


@st.composite
def preorder_parents(draw, n):
    """The parents [n] of a tree in depth-first preorder: each node hangs off the node before it,
    one of that node's ancestors, or the root (-1)."""
    parents, path = [], []
    for node in range(n):
        del path[draw(st.integers(0, len(path))):]  # the nodes that stay above this one
        parents.append(path[-1] if path else -1)
        path.append(node)
    return np.array(parents, np.int32)


@st.composite
def drafts_with_proposal(draw):
    """(draft_token_ids [n], Proposal, parents) consistent with each other, for each proposal kind,
    a chain (parents None) or a tree (distinct tokens: point-mass siblings must differ)."""
    n = draw(small)
    tree = draw(st.booleans())
    drafts = draw(hnp.arrays(np.int32, n, elements=st.integers(0, 2**31 - 1), unique=True)) if tree \
        else draw(token_ids(n, n))
    parents = draw(preorder_parents(n)) if tree else None
    kind = draw(st.sampled_from(["point_mass", "sparse", "dense"]))
    if kind == "point_mass":
        return drafts, Proposal(), parents
    if kind == "dense":
        vocab = draw(st.integers(1, 8))
        return drafts, Proposal(kind="dense", probs=draw(prob_arrays((n, vocab))), draft_vocab_size=vocab), parents
    support = draw(st.integers(1, 4))
    ids = draw(hnp.arrays(np.int32, (n, support), elements=st.integers(-1, 2**31 - 1)))
    probs = draw(prob_arrays((n, support)))
    ids[:, 0] = drafts  # the draft token is in its own support, with some mass
    probs[:, 0] = np.maximum(probs[:, 0], 0.25)
    return drafts, Proposal(kind="sparse", ids=ids, probs=probs), parents


@st.composite
def batch_rows(draw, make_row):
    """Rows with distinct request ids, their row indices shuffled (receivers may reorder)."""
    names = draw(st.lists(request_ids, unique=True, max_size=3))
    order = draw(st.permutations(range(len(names))))
    return [draw(make_row(name, index)) for name, index in zip(names, order)]


@st.composite
def feature_blocks(draw):
    n, e = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    return FeatureBlock(start=draw(counts), shape=[n, e], data=draw(st.binary(min_size=2 * n * e, max_size=2 * n * e)))


@st.composite
def draft_row(draw, request_id, row):
    return DraftRow(request_id=request_id, row=row, step=draw(counts), cached_len=draw(counts),
                    new_token_ids=draw(token_ids()), num_draft=draw(st.integers(0, 16)),
                    draft_mode=draw(st.sampled_from(["greedy", "sample"])), sampling=draw(row_samplings),
                    features=draw(st.none() | feature_blocks()))


@st.composite
def draft_result(draw, request_id, row):
    drafts, proposal, parents = draw(drafts_with_proposal())
    return DraftResult(request_id=request_id, draft_token_ids=drafts, parents=parents, proposal=proposal,
                       need_resync=draw(st.booleans()))


@st.composite
def verify_row(draw, request_id, row):
    drafts, proposal, parents = draw(drafts_with_proposal())
    return VerifyRow(request_id=request_id, row=row, step=draw(counts), cached_len=draw(counts),
                     new_token_ids=draw(token_ids()), draft_token_ids=drafts, parents=parents, proposal=proposal,
                     sampling=draw(row_samplings), logprobs=draw(logprob_options),
                     postprocessor_id=draw(st.none() | instance_ids), prompt_len=draw(counts),
                     is_retry=draw(st.booleans()), features_from=draw(st.none() | counts))


@st.composite
def verify_result(draw, request_id, row):
    num_draft = draw(st.integers(0, 16))
    num_accepted = draw(st.integers(0, num_draft))
    emitted = draw(token_ids(num_accepted + 1, num_accepted + 1))
    if num_accepted == 0 and draw(st.booleans()):
        emitted = emitted[:0]
    return VerifyResult(request_id=request_id, step=draw(counts), token_ids=emitted, num_draft=num_draft,
                        num_accepted=num_accepted, need_resync=draw(st.booleans()),
                        residual_fallback=draw(st.booleans()), error=draw(st.none() | errors),
                        features=draw(st.none() | feature_blocks()))


@st.composite
def logprob_stats(draw, n, with_logz):
    num_top, num_requested = draw(small), draw(small)
    return LogprobArrays(
        token_logprobs=draw(logprob_arrays(n)),
        top_ids=draw(hnp.arrays(np.int32, (n, num_top), elements=st.integers(-1, 2**31 - 1))),
        top_logprobs=draw(logprob_arrays((n, num_top))), requested_logprobs=draw(logprob_arrays((n, num_requested))),
        ranks=draw(st.none() | hnp.arrays(np.int32, n, elements=st.integers(1, 2**31 - 1))),
        logz_k=draw(logprob_arrays(n)) if with_logz else None)


@st.composite
def side_channel_records(draw):
    n = draw(small)
    mode = draw(st.sampled_from(["raw", "processed"]))
    with_logz = mode == "processed" or draw(st.booleans())
    return SideChannelRecord(
        request_id=draw(request_ids), batch_id=draw(counts), step=draw(counts), verifier_id=draw(instance_ids),
        mode=mode, token_ids=draw(token_ids(n, n)), logprobs=draw(st.none() | logprob_stats(n, with_logz)),
        masks=draw(st.none() | st.lists(sampling_masks(), min_size=n, max_size=n)),
        prompt_logprobs=draw(st.none() | logprob_stats(draw(small), with_logz)), prompt_offset=draw(counts))


@st.composite
def commits(draw):
    num_draft = draw(st.integers(0, 16))
    return Commit(
        request_id=draw(request_ids), batch_id=draw(counts), step=draw(counts), seq=draw(counts),
        scheduler_id=draw(instance_ids), client_inbox=draw(st.text(min_size=1, max_size=40)),
        token_ids=draw(token_ids()), num_draft=num_draft, num_accepted=draw(st.integers(0, num_draft)),
        finish_reason=draw(finish_reasons), degraded=draw(degraded), expect_side_channel=draw(st.booleans()),
        usage=draw(st.none() | usages), prompt_token_ids=draw(st.none() | token_ids()),
        logprobs=draw(logprob_options), stop=draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)),
        stream=draw(st.booleans()), resume_token_ids=draw(st.none() | token_ids()))


STRATEGIES = {
    GenerateRequest: generate_requests(),
    CancelRequest: st.builds(CancelRequest, request_id=request_ids),
    Error: errors,
    StreamChunk: stream_chunks(),
    Admitted: st.builds(Admitted, request_id=request_ids, scheduler_id=instance_ids, started=st.booleans()),
    DraftRequest: st.builds(DraftRequest, batch_id=counts, scheduler_id=instance_ids, deadline=deadlines,
                            rows=batch_rows(draft_row)),
    DraftResponse: st.builds(DraftResponse, batch_id=counts, drafter_id=instance_ids, rows=batch_rows(draft_result)),
    VerifyRequest: st.builds(VerifyRequest, batch_id=counts, scheduler_id=instance_ids, deadline=deadlines,
                             rows=batch_rows(verify_row)),
    VerifyResponse: st.builds(VerifyResponse, batch_id=counts, verifier_id=instance_ids,
                              rows=batch_rows(verify_result)),
    SideChannelRecord: side_channel_records(),
    Commit: commits(),
    StopNotice: st.builds(StopNotice, request_id=request_ids, batch_id=counts, step=counts,
                          postprocessor_id=instance_ids, reason=st.sampled_from(["stop", "error"]),
                          stop=st.none() | texts, text_offset=counts, num_tokens=counts),
    Heartbeat: st.builds(Heartbeat, instance_id=instance_ids,
                         role=st.sampled_from(["scheduler", "drafter", "verifier", "postprocessor"]),
                         capacity=counts, load=counts, free_slots=st.none() | counts,
                         model_ids=st.dictionaries(st.sampled_from(["target", "draft"]), texts),
                         sent_at=st.floats(0, 1e10), interval_s=st.floats(0.01, 60)),
}


def test_every_message_type_has_a_round_trip_strategy():
    assert set(STRATEGIES) == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("message_type", list(STRATEGIES), ids=lambda t: t.__name__)
@FEW
@given(data=st.data())
def test_round_trip(message_type, data):
    message = data.draw(STRATEGIES[message_type])
    payload = encode(message)
    decoded = decode(payload, message_type)
    assert decoded == message
    assert decode_any(payload) == message


def test_arrays_travel_packed_not_as_number_lists():
    request = GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
    raw = msgpack.unpackb(encode(request))
    assert raw["prompt_token_ids"] == {"dtype": "int32", "shape": [3],
                                       "data": b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00"}
    assert raw["v"] == PROTOCOL_VERSION and raw["type"] == "generate"


def test_round_trip_keeps_dtype_shape_and_minus_inf():
    probs = np.array([[0.5, 0.25], [1.0, 0.0]], np.float16)
    record = SideChannelRecord(
        request_id="r", batch_id=3, step=1, verifier_id="v0", token_ids=[7, 8],
        logprobs=LogprobArrays(token_logprobs=[-0.1, -np.inf], top_ids=[[7, -1], [8, -1]],
                               top_logprobs=[[-0.1, -np.inf], [-2.0, -np.inf]], requested_logprobs=np.zeros((2, 0))))
    decoded = decode(encode(record), SideChannelRecord)
    assert decoded.logprobs.top_logprobs.dtype == np.float32
    assert decoded.logprobs.top_logprobs.shape == (2, 2)
    assert np.isneginf(decoded.logprobs.token_logprobs[1])
    proposal = Proposal(kind="dense", probs=probs, draft_vocab_size=2)
    row = DraftResult(request_id="r", draft_token_ids=[4, 9], proposal=proposal)
    response = decode(encode(DraftResponse(batch_id=1, drafter_id="d0", rows=[row])), DraftResponse)
    decoded_probs = response.rows[0].proposal.probs
    assert decoded_probs.dtype == np.float16
    np.testing.assert_array_equal(decoded_probs, probs)


VALID = encode(CancelRequest(request_id="r1"))


@pytest.mark.parametrize("payload, what", [
    (b"", "empty"),
    (b"\xc1", "reserved byte"),
    (VALID[:-3], "truncated"),
    (VALID + b"\x00", "trailing bytes"),
    (msgpack.packb([1, 2, 3]), "not a map"),
    (msgpack.packb("generate"), "a string"),
    (b"\xc6\x7f\xff\xff\xff" + b"\x00" * 8, "bin header claiming 2 GiB"),
    (b"\xdd\xff\xff\xff\xff", "array header claiming 4G entries"),
    (b"\x91" * 200_000, "deep nesting"),
    (msgpack.packb({1: 2}), "non-string key"),
    (b"\x81\xa2\xc3\x28\x01", "invalid UTF-8"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_malformed_bytes_are_refused(payload, what):
    with pytest.raises(CodecError, match="malformed") as caught:
        decode(payload, CancelRequest)
    assert caught.value.code == ErrorCode.malformed
    # the message says what is wrong, never an empty text after a colon (deep nesting has none of its own)
    assert caught.value.message.strip() and not caught.value.message.rstrip().endswith(":")


def test_oversized_payload_is_refused_before_unpacking():
    payload = encode(GenerateRequest(request_id="r", prompt="x" * 5000))
    with pytest.raises(CodecError, match="exceeds the 4096 byte limit") as caught:
        decode(payload, GenerateRequest, max_bytes=4096)
    assert caught.value.code == ErrorCode.too_large
    assert decode(payload, GenerateRequest, max_bytes=len(payload)).prompt == "x" * 5000


@pytest.mark.parametrize("message", [
    CancelRequest(request_id="r1"),
    Heartbeat(instance_id="v1", role="verifier", capacity=8, load=0, sent_at=1.0, interval_s=0.5),
], ids=lambda message: message.type)
@pytest.mark.parametrize("version", [1, PROTOCOL_VERSION + 1, 0, None, str(PROTOCOL_VERSION), True])
def test_unknown_protocol_version_is_refused(message, version):
    """1: a peer from before tree drafts, whose messages (a heartbeat included) never decode."""
    raw = message.model_dump()
    raw["v"] = version
    with pytest.raises(CodecError, match="protocol version") as caught:
        decode(msgpack.packb(raw, use_bin_type=True), type(message))
    assert (caught.value.code, caught.value.field) == (ErrorCode.unsupported_version, "v")


def test_missing_version_is_refused():
    with pytest.raises(CodecError, match="protocol version None") as caught:
        decode_any(msgpack.packb({"type": "cancel", "request_id": "r1"}))
    assert (caught.value.code, caught.value.field) == (ErrorCode.unsupported_version, "v")


def test_wrong_message_type_is_refused():
    with pytest.raises(CodecError, match="expected a 'generate' message, got 'cancel'") as caught:
        decode(VALID, GenerateRequest)
    assert (caught.value.code, caught.value.field) == (ErrorCode.wrong_message_type, "type")


@pytest.mark.parametrize("type_value", ["teleport", None, 7])
def test_unknown_or_missing_type_is_refused(type_value):
    with pytest.raises(CodecError, match="type") as caught:
        decode_any(msgpack.packb({"v": PROTOCOL_VERSION, "type": type_value, "request_id": "r1"}))
    assert (caught.value.code, caught.value.field) == (ErrorCode.wrong_message_type, "type")


@FEW
@given(payload=st.binary(max_size=64))
def test_random_bytes_only_ever_raise_codec_error(payload):
    try:
        decode_any(payload)
    except CodecError:
        pass


json_leaves = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=5)
               | st.binary(max_size=9))
json_values = st.recursive(json_leaves, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=3), max_leaves=8)


@FEW
@given(message_type=st.sampled_from(list(STRATEGIES)), data=st.data())
def test_hostile_field_values_only_ever_raise_codec_error(message_type, data):
    """A valid message with one field replaced by arbitrary msgpack data decodes or fails typed."""
    raw = data.draw(STRATEGIES[message_type]).model_dump()
    raw[data.draw(st.sampled_from(sorted(set(raw) - {"v", "type"})))] = data.draw(json_values)
    try:
        decode(msgpack.packb(raw, use_bin_type=True), message_type)
    except CodecError as exc:
        assert exc.code == ErrorCode.invalid_field and exc.field


@pytest.mark.parametrize("change, field, message", [
    ({"data": bytes(15)}, "rows[0].features.data", "15 bytes do not hold a bfloat16 matrix of shape [2, 4]"),
    ({"data": "x" * 16}, "rows[0].features.data", "valid bytes"),
    ({"shape": [0, 4], "data": b""}, "rows[0].features.shape", "n >= 1 positions"),
    ({"shape": [2, 0], "data": b""}, "rows[0].features.shape", "1 <= E <= 65536"),
    ({"shape": [2, 1 << 17], "data": b""}, "rows[0].features.shape", "1 <= E <= 65536"),
    ({"shape": [1 << 40, 8]}, "rows[0].features.shape", "over the 4194304 bytes of a block"),
    ({"shape": [8]}, "rows[0].features.shape", "at least 2 items"),
    ({"dtype": "float32"}, "rows[0].features.dtype", "'bfloat16'"),
])
def test_a_bad_feature_block_is_refused_naming_its_field(change, field, message):
    result = VerifyResult(request_id="r", step=0, features=FeatureBlock(start=3, shape=[2, 4], data=bytes(16)))
    raw = msgpack.unpackb(encode(VerifyResponse(batch_id=1, verifier_id="v", rows=[result])))
    raw["rows"][0]["features"].update(change)
    with pytest.raises(CodecError, match=re.escape(message)) as raised:
        decode(msgpack.packb(raw), VerifyResponse)
    assert (raised.value.code, raised.value.field) == (ErrorCode.invalid_field, field)


def test_error_reply_from_typed_error_keeps_code_and_field():
    exc = SpecbusError(ErrorCode.invalid_field, "Input should be less than or equal to 1", "sampling.top_p")
    reply = decode(error_reply(exc, request_id="r9"), Error)
    assert (reply.code, reply.field, reply.request_id) == (ErrorCode.invalid_field, "sampling.top_p", "r9")
    assert reply.message == "Input should be less than or equal to 1"


def test_error_reply_hides_unexpected_exception_details():
    reply = decode(error_reply(KeyError("secret_internal_key"), request_id="r9"), Error)
    assert reply.code == ErrorCode.internal
    assert "secret" not in reply.message


def test_error_reply_from_code():
    reply = decode_any(error_reply(ErrorCode.overloaded, "queue full (64 waiting)", request_id="r2"))
    assert isinstance(reply, Error)
    assert (reply.code, reply.message, reply.field) == (ErrorCode.overloaded, "queue full (64 waiting)", None)
