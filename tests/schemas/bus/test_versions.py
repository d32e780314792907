"""Version windows: what a process accepts, what it sends in, and a heartbeat's copies."""

import time

import msgpack
import pytest

from schemas import PROTOCOL_MIN, PROTOCOL_VERSION, CodecError, ErrorCode, GenerateRequest, Heartbeat, StreamChunk
from schemas.bus.codec import decode, decode_heartbeat, encode, encode_beats, reply_version
from schemas.bus.versions import MIN_ENV, REHEARSAL_KEY, REHEARSAL_VERSION, VERSION_ENV, WINDOW, Window, read_window

N = PROTOCOL_VERSION
OLD, BOTH, NEW = Window(N, N), Window(N, N + 1), Window(N + 1, N + 1)


def test_a_process_speaks_its_release_unless_told_to_rehearse_the_next():
    assert WINDOW == read_window({}) == Window(PROTOCOL_MIN, N)
    assert read_window({VERSION_ENV: str(N + 1)}) == BOTH
    assert read_window({VERSION_ENV: str(N + 1), MIN_ENV: str(N + 1)}) == NEW
    assert REHEARSAL_VERSION == N + 1


@pytest.mark.parametrize("env", [{VERSION_ENV: str(N + 2)}, {VERSION_ENV: "three"}, {MIN_ENV: str(N + 1)},
                                 {VERSION_ENV: str(PROTOCOL_MIN - 1)}])
def test_a_window_this_code_cannot_speak_is_refused_at_start(env):
    with pytest.raises(ValueError, match=VERSION_ENV):
        read_window(env)


def test_the_version_sent_is_the_highest_every_side_speaks():
    assert BOTH.toward() == N + 1  # nobody else to please
    assert BOTH.toward(N) == N and BOTH.toward(N + 1) == N + 1 and BOTH.toward(N + 1, N) == N
    assert OLD.toward(N + 1) == N and NEW.toward(N) == N + 1  # no overlap: the peer refuses it, typed


def request(v: int | None = None) -> bytes:
    return encode(GenerateRequest(request_id="r1", prompt="x = 1"), v)


@pytest.mark.parametrize("receiver, sent, accepted", [
    (OLD, N, True), (OLD, N + 1, False), (BOTH, N, True), (BOTH, N + 1, True), (NEW, N, False), (NEW, N + 1, True)])
def test_a_receiver_takes_every_version_of_its_window_and_refuses_the_others_typed(receiver, sent, accepted):
    if accepted:
        assert decode(request(sent), GenerateRequest, window=receiver).v == sent
    else:
        with pytest.raises(CodecError, match="not supported") as refused:
            decode(request(sent), GenerateRequest, window=receiver)
        assert refused.value.code == ErrorCode.unsupported_version and refused.value.field == "v"


def test_the_rehearsal_version_changes_every_message_as_a_real_bump_would():
    """N+1 carries a key N does not know: sent in N it is refused as unknown, and N+1 without it
    is refused as incomplete, so a message sent in the wrong version cannot pass unnoticed."""
    assert msgpack.unpackb(request(N + 1))[REHEARSAL_KEY] is True
    assert REHEARSAL_KEY not in msgpack.unpackb(request(N))
    raw = msgpack.unpackb(request(N))
    with pytest.raises(CodecError) as unknown:
        decode(msgpack.packb({**raw, REHEARSAL_KEY: True}), GenerateRequest, window=BOTH)
    assert unknown.value.code == ErrorCode.invalid_field and unknown.value.field == REHEARSAL_KEY
    with pytest.raises(CodecError) as missing:
        decode(msgpack.packb({**raw, "v": N + 1}), GenerateRequest, window=BOTH)
    assert missing.value.code == ErrorCode.invalid_field and missing.value.field == REHEARSAL_KEY


def beat(window: Window) -> Heartbeat:
    return Heartbeat(instance_id="v-0", role="verifier", capacity=4, load=0, protocol_min=window.low,
                     protocol_version=window.high, sent_at=time.time(), interval_s=1.0)


@pytest.mark.parametrize("sender", [OLD, BOTH, NEW])
@pytest.mark.parametrize("receiver", [OLD, BOTH, NEW])
def test_a_heartbeat_goes_once_per_version_and_each_receiver_keeps_one_copy(sender, receiver):
    copies = encode_beats(beat(sender), sender)
    assert [msgpack.unpackb(c)["v"] for c in copies] == list(sender.versions())
    if sender.high < receiver.low or receiver.high < sender.low:  # no version in common: a real misfit
        with pytest.raises(CodecError) as refused:
            [decode_heartbeat(c, receiver) for c in copies]
        assert refused.value.code == ErrorCode.unsupported_version
        return
    kept = [b for b in (decode_heartbeat(c, receiver) for c in copies) if b is not None]
    assert len(kept) == 1 and kept[0].v == receiver.toward(sender.high)
    assert (kept[0].protocol_min, kept[0].protocol_version) == (sender.low, sender.high)


@pytest.mark.parametrize("v", [N - 1, N + 1, 0, -1, 2**40])
def test_a_beat_in_a_version_its_own_window_lacks_is_no_copy_but_a_bad_message(v):
    """A copy for other versions is passed over in silence; a beat whose version lies outside the
    window it claims is refused (the receiver counts it), whatever its window shares with ours."""
    raw = beat(OLD).model_dump()
    with pytest.raises(CodecError) as refused:
        decode_heartbeat(msgpack.packb({**raw, "v": v}), OLD)
    assert refused.value.code == ErrorCode.unsupported_version and refused.value.field == "v"


def test_a_reply_goes_in_the_version_of_what_it_answers():
    assert reply_version(request(N + 1), BOTH) == N + 1
    assert reply_version(request(N + 1), OLD) == N  # refused: answered in what the sender likely reads
    assert reply_version(b"\xc1 not msgpack", BOTH) == N
    chunk = decode(encode(StreamChunk(request_id="r1", seq=0), N + 1), StreamChunk, window=BOTH)
    assert chunk.v == N + 1 and decode(encode(chunk), StreamChunk, window=BOTH).v == N + 1
