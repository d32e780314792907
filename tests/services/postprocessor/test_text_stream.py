"""TextStream (services/postprocessor/text_stream.py) alone, with the tiny target's real byte-level
tokenizer (through TokenBytes): stop strings cut exactly at the token that completes them, the
held-back tail, whole characters across token boundaries, no U+FFFD for an unfinished last
character, and a replay that continues exactly where streaming stopped."""

import numpy as np
import pytest

from schemas.config import TINY_TARGET
from services.postprocessor.text_stream import TextStream, find_stop
from text.token_bytes import TokenBytes
from text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def token_bytes():
    return TokenBytes(load_tokenizer(TINY_TARGET))


def ids(token_bytes, text: str) -> np.ndarray:
    return np.asarray(token_bytes.tokenizer.encode(text), np.int32)


def stream_text(token_bytes, text: str, stop: list[str], pieces: int) -> tuple[TextStream, list[str], int | None]:
    """Feed text's tokens in `pieces` chunks; (the stream, each chunk's text, the tokens kept in
    all when a stop string matched, else None)."""
    stream = TextStream.start(None, stop)
    out, num_kept = [], 0
    for index, part in enumerate(np.array_split(ids(token_bytes, text), pieces)):
        final = index == pieces - 1
        kept, match = stream.feed(token_bytes, part, final)
        num_kept += kept
        out.append(stream.take(final or match is not None))
        if match is not None:
            return stream, out, num_kept
    return stream, out, None


def test_find_stop_takes_the_earliest_match_at_or_after_start():
    assert find_stop("abc STOP xyz END", ["END", "STOP"], 0) == (4, "STOP")
    assert find_stop("abc STOP xyz END", ["END", "STOP"], 5) == (13, "END")
    assert find_stop("abc", ["STOP"], 0) is None


def test_without_stop_strings_the_chunks_join_to_the_decoded_text(token_bytes):
    text = "hello world here é"
    _, out, kept = stream_text(token_bytes, text, [], pieces=4)
    assert "".join(out) == token_bytes.tokenizer.decode(token_bytes.tokenizer.encode(text)) and kept is None


@pytest.mark.parametrize("pieces", [1, 2, 3, 5])
@pytest.mark.parametrize("stop, before", [("STOP", "hello world "), ("ld ST", "hello wor")])  # one token, two
def test_a_stop_string_is_cut_exactly_however_the_tokens_are_split(token_bytes, pieces, stop, before):
    text = "hello world STOP here"
    stream, out, kept = stream_text(token_bytes, text, [stop], pieces)
    assert "".join(out) == before == stream.text
    token_ids = token_bytes.tokenizer.encode(text)
    assert stop in token_bytes.tokenizer.decode(token_ids[:kept]) and stop not in token_bytes.tokenizer.decode(token_ids[:kept - 1])


def test_the_tail_a_later_stop_could_cut_is_held_back_until_done(token_bytes):
    stream = TextStream.start(None, ["world"])
    assert stream.holdback == len("world") - 1
    stream.feed(token_bytes, ids(token_bytes, "hello wor"), final=False)
    assert stream.take(done=False) == "hello wor"[:-stream.holdback]
    assert stream.take(done=True) == "hello wor"[-stream.holdback:]


def test_a_character_split_across_tokens_streams_whole(token_bytes):
    token_ids = ids(token_bytes, "é")
    assert len(token_ids) > 1  # byte-level: one character, two tokens
    stream = TextStream.start(None, [])
    stream.feed(token_bytes, token_ids[:1], final=False)
    assert stream.take(done=False) == ""
    stream.feed(token_bytes, token_ids[1:], final=True)
    assert stream.take(done=True) == "é"


def test_replay_continues_the_stream_with_no_gap_and_no_repeat(token_bytes):
    text, cut = "hello world STOP here", 3
    token_ids = ids(token_bytes, text)
    alone, out, _ = stream_text(token_bytes, text, ["ST0P"], pieces=1)
    moved = TextStream.start(None, ["ST0P"])
    sent = moved.replay(token_bytes, token_ids[:cut])
    moved.feed(token_bytes, token_ids[cut:], final=True)
    assert sent + moved.take(done=True) == "".join(out) == alone.text


@pytest.mark.parametrize("pieces", [1, 2])
def test_a_request_that_ends_inside_a_character_drops_its_unfinished_bytes(token_bytes, pieces):
    """The last token leaves a character unfinished: the text ends before it, never in U+FFFD
    (the logprobs' `bytes` keep those bytes), however the tokens came."""
    token_ids = ids(token_bytes, "Wo€")[:-1]  # "€" is three tokens of one byte: two of them sent
    assert token_bytes.tokenizer.decode(token_ids).endswith("\ufffd")
    stream = TextStream.start(None, [])
    out = []
    for index, part in enumerate(np.array_split(token_ids, pieces)):
        stream.feed(token_bytes, part, final=index == pieces - 1)
        out.append(stream.take(done=index == pieces - 1))
    assert "".join(out) == "Wo" == stream.text


def test_a_replacement_character_the_model_wrote_is_kept_at_the_end(token_bytes):
    stream = TextStream.start(None, [])
    stream.feed(token_bytes, ids(token_bytes, "a\ufffd"), final=True)
    assert stream.take(done=True) == "a\ufffd"
