"""TextStream (services/pipeline/text_stream.py) alone, with the tiny target's real byte-level
tokenizer: stop strings cut exactly at the token that completes them, the held-back tail, whole
characters across token boundaries, and a replay that continues exactly where streaming stopped."""

import numpy as np
import pytest

from schemas.config import TINY_TARGET
from services.pipeline.text_stream import TextStream, find_stop
from text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TARGET)


def ids(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), np.int32)


def stream_text(tokenizer, text: str, stop: list[str], pieces: int) -> tuple[TextStream, list[str], int | None]:
    """Feed text's tokens in `pieces` chunks; (the stream, each chunk's text, the tokens kept in
    all when a stop string matched, else None)."""
    stream = TextStream.start(None, stop)
    out, num_kept = [], 0
    for index, part in enumerate(np.array_split(ids(tokenizer, text), pieces)):
        final = index == pieces - 1
        kept, match = stream.feed(tokenizer, part, final)
        num_kept += kept
        out.append(stream.take(final or match is not None))
        if match is not None:
            return stream, out, num_kept
    return stream, out, None


def test_find_stop_takes_the_earliest_match_at_or_after_start():
    assert find_stop("abc STOP xyz END", ["END", "STOP"], 0) == (4, "STOP")
    assert find_stop("abc STOP xyz END", ["END", "STOP"], 5) == (13, "END")
    assert find_stop("abc", ["STOP"], 0) is None


def test_without_stop_strings_the_chunks_join_to_the_decoded_text(tokenizer):
    text = "hello world here é"
    _, out, kept = stream_text(tokenizer, text, [], pieces=4)
    assert "".join(out) == tokenizer.decode(tokenizer.encode(text)) and kept is None


@pytest.mark.parametrize("pieces", [1, 2, 3, 5])
@pytest.mark.parametrize("stop, before", [("STOP", "hello world "), ("ld ST", "hello wor")])  # one token, two
def test_a_stop_string_is_cut_exactly_however_the_tokens_are_split(tokenizer, pieces, stop, before):
    text = "hello world STOP here"
    stream, out, kept = stream_text(tokenizer, text, [stop], pieces)
    assert "".join(out) == before == stream.text
    token_ids = tokenizer.encode(text)
    assert stop in tokenizer.decode(token_ids[:kept]) and stop not in tokenizer.decode(token_ids[:kept - 1])


def test_the_tail_a_later_stop_could_cut_is_held_back_until_done(tokenizer):
    stream = TextStream.start(None, ["world"])
    assert stream.holdback == len("world") - 1
    stream.feed(tokenizer, ids(tokenizer, "hello wor"), final=False)
    assert stream.take(done=False) == "hello wor"[:-stream.holdback]
    assert stream.take(done=True) == "hello wor"[-stream.holdback:]


def test_a_character_split_across_tokens_streams_whole(tokenizer):
    token_ids = ids(tokenizer, "é")
    assert len(token_ids) > 1  # byte-level: one character, two tokens
    stream = TextStream.start(None, [])
    stream.feed(tokenizer, token_ids[:1], final=False)
    assert stream.take(done=False) == ""
    stream.feed(tokenizer, token_ids[1:], final=True)
    assert stream.take(done=True) == "é"


def test_replay_continues_the_stream_with_no_gap_and_no_repeat(tokenizer):
    text, cut = "hello world STOP here", 3
    token_ids = ids(tokenizer, text)
    alone, out, _ = stream_text(tokenizer, text, ["ST0P"], pieces=1)
    moved = TextStream.start(None, ["ST0P"])
    sent = moved.replay(tokenizer, token_ids[:cut])
    moved.feed(tokenizer, token_ids[cut:], final=True)
    assert sent + moved.take(done=True) == "".join(out) == alone.text
