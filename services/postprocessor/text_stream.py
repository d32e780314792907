"""One request's completion text: incremental detokenization, stop strings, the held-back tail.

`TextStream.feed` detokenizes one token at a time (text.tokenizer.detokenize_step), so a stop
string is located at the token that completes it: the text is cut at the match (it never
includes the stop string) and the tokens kept end with the one that completed it. While a
request has stop strings, `take` holds back the last (longest stop - 1) characters, so a stop
string split across chunks is cut exactly. A character split across tokens is emitted whole
once its last token comes; a request whose last token leaves a character unfinished ends its text
before that character: its final chunk carries no U+FFFD for the bytes the cut left over (the
logprobs of those tokens still carry them, `bytes` exact), while a U+FFFD the model wrote as a
whole character stays. `replay` rebuilds, from the same tokens, the state a postprocessor that
died had: the same text and the same held-back tail, so the stream continues with no gap and no
repeat. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from text.token_bytes import TokenBytes, incomplete_tail
from text.tokenizer import REPLACEMENT_CHAR, DetokenizerState, detokenize_step, new_detokenizer_state

StopMatch = tuple[int, str]  # (character position of the match in the completion text, the stop string)


@dataclass
class TextStream:
    """`text` is the completion text so far (cut at a stop string), `sent_chars` how much of it
    has been taken for chunks."""

    stop: list[str]
    detok: DetokenizerState
    text: str = ""
    sent_chars: int = 0

    @classmethod
    def start(cls, prompt_token_ids: np.ndarray | None, stop: Iterable[str]) -> TextStream:
        """The stream of a request whose completion starts after prompt_token_ids (None: unknown here)."""
        context = prompt_token_ids if prompt_token_ids is not None else ()
        return cls(stop=list(stop), detok=new_detokenizer_state(context))

    @property
    def holdback(self) -> int:
        """Characters at the end of `text` that a stop string completed later could still cut."""
        return max(map(len, self.stop), default=1) - 1

    def feed(self, token_bytes: TokenBytes, token_ids: np.ndarray, final: bool) -> tuple[int, StopMatch | None]:
        """Detokenize token_ids one at a time; (tokens kept, the stop match or None). final: the
        request's last tokens (the detokenizer flushes what it held, less an unfinished last
        character: module docstring)."""
        ids = token_ids.tolist()
        if final and not ids:
            return 0, self._append(self._flush(token_bytes, []))
        for index, token_id in enumerate(ids):
            if final and index == len(ids) - 1:
                delta = self._flush(token_bytes, [token_id])
            else:
                self.detok, delta = detokenize_step(token_bytes.tokenizer, self.detok, [token_id])
            match = self._append(delta)
            if match is not None:
                return index + 1, match
        return len(ids), None

    def _flush(self, token_bytes: TokenBytes, last_ids: list[int]) -> str:
        """The delta of the request's last tokens: what the detokenizer held and they add, its
        final U+FFFD dropped when it stands for a character the bytes begin and do not finish."""
        pending = self.detok.ids[self.detok.read_offset:] + last_ids
        self.detok, delta = detokenize_step(token_bytes.tokenizer, self.detok, last_ids, final=True)
        if delta.endswith(REPLACEMENT_CHAR) and incomplete_tail(token_bytes.generated(pending)):
            delta = delta[:-1]
        return delta

    def replay(self, token_bytes: TokenBytes, token_ids: np.ndarray) -> str:
        """Feed tokens another postprocessor already streamed, as `feed` did there (no stop
        check: they were sent, so none matched); returns the text that was sent for them."""
        for token_id in token_ids.tolist():
            self.detok, delta = detokenize_step(token_bytes.tokenizer, self.detok, [token_id])
            self.text += delta
        self.sent_chars = max(0, len(self.text) - self.holdback)
        return self.text[:self.sent_chars]

    def take(self, done: bool) -> str:
        """The text not taken yet, less the held-back tail unless the request is done."""
        end = len(self.text) if done else max(self.sent_chars, len(self.text) - self.holdback)
        text = self.text[self.sent_chars:end]
        self.sent_chars = end
        return text

    def _append(self, delta: str) -> StopMatch | None:
        if not delta:
            return None
        start = max(0, len(self.text) - self.holdback)  # a match must end inside the new text
        self.text += delta
        match = find_stop(self.text, self.stop, start)
        if match is not None:
            self.text = self.text[:match[0]]
        return match


def find_stop(text: str, stops: list[str], start: int) -> StopMatch | None:
    """The earliest occurrence at or after `start` of any stop string: (position, stop)."""
    found = [(position, stop) for stop in stops if (position := text.find(stop, start)) >= 0]
    return min(found) if found else None
