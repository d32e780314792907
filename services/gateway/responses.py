"""The OpenAI API's responses, NATS-free: StreamChunks turned into OpenAI choices, whole
responses and SSE chunks, with usage and logprobs in OpenAI's (and vLLM's) shapes.

`usage` holds OpenAI's fields only, the draft tokens as OpenAI counts predicted outputs
(completion_tokens_details.accepted_prediction_tokens / rejected_prediction_tokens: a draft token
the target kept / one it refused), summed over the choices, each prompt's tokens counted once; our
extras sit next to the OpenAI fields: a top-level `speculation` {draft_tokens_proposed,
draft_tokens_accepted, acceptance_rate, steps, speculative_lengths} wherever `usage` is, and per
choice `degraded`: in a streamed chunk the reasons that chunk was flagged with (e.g.
draft_timeout), in a whole response every reason seen, when there is any.

Logprob shapes (as vLLM's OpenAI server gives them):
- completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"};
  a top_logprobs dict holds the top-N and the chosen token; with `echo` the prompt tokens come
  first, the first one with logprob null (it has no context). text_offset[i] is where token i
  begins in the choice's text, so the offsets always agree with the text returned: an echoed
  prompt given as token ids is the concatenation of its tokens, special tokens included (as text
  it is echoed as given); a generated special token, which the text leaves out, takes no room;
  a character split across tokens begins in the first of them.
- prompt_logprobs (vLLM's extension): per prompt token null (the first) or {token id: {"logprob",
  "rank", "decoded_token"}} for the top-N and the prompt's own token; per choice in completions,
  next to `choices` in chat completions.
- chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
A token's text is its own bytes decoded (services/gateway/token_texts.py: a token that ends inside
a UTF-8 character shows U+FFFD; `bytes` keeps the exact bytes). A request that ends inside a
character has text without its unfinished bytes (services/postprocessor/text_stream.py), while its
last tokens' logprobs still list them, `bytes` exact. A logprob of -inf (outside the candidate set
in logprobs_mode "processed") is written -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from schemas.streams import StreamChunk, TokenLogprob, Usage
from services.client import json_logprob as client_json_logprob
from services.gateway.api_errors import ApiError
from services.gateway.token_texts import TokenTexts

NEG_INF_LOGPROB = -9999.0  # vLLM's stand-in for -inf
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
HEARTBEATS_MISSED = 3  # a verifier silent for this many of its intervals no longer counts for max_model_len
json_logprob = partial(client_json_logprob, infinite=NEG_INF_LOGPROB)


@dataclass
class Choice:
    """One choice's state across its chunks: what was sent so far and the logprobs wanted."""

    index: int
    texts: TokenTexts
    top_n: int | None  # logprobs wanted: top-N per token (0: the chosen one's); None: none
    echo_text: str | None = None
    prompt_top_n: int | None = None  # vLLM's prompt_logprobs wanted: top-N per prompt token
    text_offset: int = 0  # completions: characters of this choice's text so far (module docstring)
    finish_reason: str | None = None
    usage: Usage | None = None
    started: bool = False
    prompt_logprobs: list[dict | None] | None = None  # vLLM's shape, once the first chunk came

    def finish(self, chunk: StreamChunk) -> str | None:
        """The OpenAI finish_reason of a chunk; a request that timed out or was cancelled is an error."""
        if not chunk.final:
            return None
        if chunk.finish_reason == "timeout":
            raise ApiError(504, "the request ran past its timeout_s", type="timeout", code="timeout")
        if chunk.finish_reason not in FINISH_REASONS:
            raise ApiError(500, f"the request ended with {chunk.finish_reason!r}", type="server_error",
                           code=chunk.finish_reason)
        self.finish_reason, self.usage = FINISH_REASONS[chunk.finish_reason], chunk.usage
        return self.finish_reason

    def first_chunk(self, chunk: StreamChunk) -> bool:
        """True for the choice's first chunk (which carries the prompt's ids and logprobs when
        asked); keeps the prompt logprobs in vLLM's shape."""
        if self.started:
            return False
        self.started = True
        if self.prompt_top_n is not None and chunk.prompt_token_ids is not None:
            self.prompt_logprobs = vllm_prompt_logprobs(self.texts, chunk.prompt_token_ids.tolist(),
                                                        chunk.prompt_logprobs, self.prompt_top_n)
        return True

    def completion_piece(self, chunk: StreamChunk) -> dict:
        """The choice's part of a completion (its text so far or its delta), with logprobs."""
        text, ids = chunk.text, chunk.token_ids.tolist()
        entries = list(chunk.logprobs) if chunk.logprobs is not None else [None] * len(ids)
        first = self.first_chunk(chunk)
        prompt_ids: list[int] = []
        prompt_entries: list[TokenLogprob | None] = []
        if first and self.echo_text is not None:
            echoed = self.echo_text
            if self.top_n is not None and chunk.prompt_token_ids is not None:
                # the prompt's tokens are listed: the echoed text is theirs, so the offsets agree with it
                prompt_ids = chunk.prompt_token_ids.tolist()
                prompt_entries = list(chunk.prompt_logprobs or [None] * len(prompt_ids))
                echoed = self.texts.join(prompt_ids)
            elif self.top_n is not None:  # no prompt tokens came: the text's characters still count
                self.text_offset += len(echoed)
            text = echoed + text
        logprobs = None
        if self.top_n is not None:
            echoed_part = self.completion_logprobs(prompt_ids, prompt_entries, echo=True)
            generated = self.completion_logprobs(ids, entries, echo=False)
            logprobs = {key: echoed_part[key] + generated[key] for key in generated}
        piece = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish(chunk)}
        if first and self.prompt_top_n is not None:
            piece["prompt_logprobs"] = self.prompt_logprobs
        return piece | ({"degraded": list(chunk.degraded)} if chunk.degraded else {})

    def completion_logprobs(self, ids: list[int], entries: Sequence[TokenLogprob | None], *, echo: bool) -> dict:
        """OpenAI's completion logprobs of tokens in a row; echo: prompt tokens (which the text
        holds whole, special ones included), else generated ones (whose text leaves special
        tokens out)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(ids, entries):
            token = self.texts.text(token_id)
            tokens.append(token)
            offsets.append(self.text_offset)
            if echo or token_id not in self.texts.skipped:
                self.text_offset += self.texts.width(token_id)
            if entry is None:  # the first prompt token, or a chunk flagged logprobs_timeout
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(json_logprob(entry.logprob))
            top = {self.texts.text(i): json_logprob(v) for i, v in entry.top[:self.top_n]}
            top.setdefault(token, json_logprob(entry.logprob))
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def chat_piece(self, chunk: StreamChunk, *, delta: bool) -> dict:
        """The choice's part of a chat completion: `delta` (streaming) or `message`."""
        self.first_chunk(chunk)
        content = None
        if self.top_n is not None:
            content = [self.chat_logprob(i, e) for i, e in zip(chunk.token_ids.tolist(), chunk.logprobs or [])]
        message = {"content": chunk.text} if delta else {"role": "assistant", "content": chunk.text}
        piece = {"index": self.index, ("delta" if delta else "message"): message,
                 "logprobs": None if content is None else {"content": content}, "finish_reason": self.finish(chunk)}
        return piece | ({"degraded": list(chunk.degraded)} if chunk.degraded else {})

    def chat_logprob(self, token_id: int, entry: TokenLogprob) -> dict:
        raw, token = self.texts.get(token_id)
        top = []
        for top_id, value in entry.top[:self.top_n]:
            top_raw, top_token = self.texts.get(top_id)
            top.append({"token": top_token, "logprob": json_logprob(value), "bytes": list(top_raw)})
        return {"token": token, "logprob": json_logprob(entry.logprob), "bytes": list(raw), "top_logprobs": top}


def merge_pieces(kind: Literal["completion", "chat"], pieces: Sequence[dict]) -> dict:
    """One non-streamed choice from its pieces in order (a non-streamed request usually has one)."""
    merged = dict(pieces[-1])
    degraded = list(dict.fromkeys(reason for p in pieces for reason in p.get("degraded", ())))
    if degraded:
        merged["degraded"] = degraded
    if "prompt_logprobs" in pieces[0]:
        merged["prompt_logprobs"] = pieces[0]["prompt_logprobs"]
    if kind == "completion":
        merged["text"] = "".join(p["text"] for p in pieces)
        logprobs = [p["logprobs"] for p in pieces if p["logprobs"] is not None]
        if logprobs:
            merged["logprobs"] = {key: [v for lp in logprobs for v in lp[key]] for key in logprobs[0]}
        return merged
    merged["message"] = {"role": "assistant", "content": "".join(p["message"]["content"] for p in pieces)}
    contents = [p["logprobs"]["content"] for p in pieces if p["logprobs"] is not None]
    if contents:
        merged["logprobs"] = {"content": [entry for content in contents for entry in content]}
    return merged


def usage_json(choices: Sequence[Choice], n: int) -> dict:
    """OpenAI's usage summed over choices (each prompt counted once), nothing else in it: the draft
    tokens as OpenAI counts a prediction's, kept or refused (module docstring)."""
    usages = [(c.index, c.usage) for c in choices if c.usage is not None]
    prompt = sum(u.prompt_tokens for index, u in usages if index % n == 0)
    completion = sum(u.completion_tokens for _, u in usages)
    proposed = sum(u.draft_tokens_proposed for _, u in usages)
    accepted = sum(u.draft_tokens_accepted for _, u in usages)
    cached = sum(u.cached_tokens for index, u in usages if index % n == 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"audio_tokens": 0, "cached_tokens": cached},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted, "audio_tokens": 0,
                                          "reasoning_tokens": 0, "rejected_prediction_tokens": proposed - accepted}}


def speculation_json(choices: Sequence[Choice]) -> dict:
    """specbus's own counts, summed over choices: the top-level `speculation` next to `usage`."""
    usages = [c.usage for c in choices if c.usage is not None]
    proposed = sum(u.draft_tokens_proposed for u in usages)
    accepted = sum(u.draft_tokens_accepted for u in usages)
    lengths = [0] * max((len(u.speculative_lengths) for u in usages), default=0)
    for usage in usages:
        for k, count in enumerate(usage.speculative_lengths):
            lengths[k] += count
    return {"draft_tokens_proposed": proposed, "draft_tokens_accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0, "steps": sum(u.steps for u in usages),
            "speculative_lengths": lengths}


def vllm_prompt_logprobs(texts: TokenTexts, ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None,
                         top_n: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first, or one without logprobs) or
    {token id: {"logprob", "rank", "decoded_token"}} for the top-N and the prompt's own token (its
    rank as the verifier gave it; a top-N entry's is its place)."""
    out: list[dict | None] = []
    for token_id, entry in zip(ids, entries or [None] * len(ids)):
        if entry is None:
            out.append(None)
            continue
        top = {str(i): {"logprob": json_logprob(v), "rank": rank, "decoded_token": texts.text(i)}
               for rank, (i, v) in enumerate(entry.top[:top_n], start=1)}
        own = top.get(str(token_id), {}).get("rank")
        top.setdefault(str(token_id), {"logprob": json_logprob(entry.logprob), "rank": entry.rank or own,
                                       "decoded_token": texts.text(token_id)})
        out.append(top)
    return out


def response_id(kind: Literal["completion", "chat"]) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + secrets.token_hex(12)


@dataclass
class Envelope:
    """The fields every response and chunk of one request repeats."""

    kind: Literal["completion", "chat"]
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or response_id(self.kind)
        self.created = self.created or int(time.time())

    def wrap(self, choices: list[dict], *, chunk: bool, usage: dict | None = None,
             speculation: dict | None = None) -> dict:
        kind = "text_completion" if self.kind == "completion" else \
            ("chat.completion.chunk" if chunk else "chat.completion")
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        body |= {"usage": usage} if usage is not None or not chunk else {}
        return body | ({"speculation": speculation} if speculation is not None else {})


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


def model_card(served_name: str, target_dir: str | Path, draft_dir: str | Path, created: int) -> dict:
    """The entry of /v1/models: the OpenAI fields, then vLLM's root and max_model_len (added per
    answer: see VerifierLimits), then ours (the draft)."""
    return {"id": served_name, "object": "model", "created": created, "owned_by": "specbus",
            "root": Path(target_dir).name, "draft_model": Path(draft_dir).name}


@dataclass
class VerifierLimits:
    """max_model_len for /v1/models, as the verifiers advertise it in their heartbeats
    (model_ids["max_seq_len"]): the smallest among those heard within a few of their intervals
    (the scheduler refuses what the smallest cannot hold), None while none is heard."""

    beats: dict[str, tuple[int, float]] = field(default_factory=dict)  # instance -> (max_seq_len, expires)
    weights: dict[str, str] = field(default_factory=dict)  # instance -> how it holds the target (model_ids)

    def observe(self, beat: Any, now: float) -> None:
        limit = str(beat.model_ids.get("max_seq_len", ""))
        if beat.role == "verifier" and limit.isdigit():
            self.beats[beat.instance_id] = (int(limit), now + HEARTBEATS_MISSED * beat.interval_s)
            self.weights[beat.instance_id] = str(beat.model_ids.get("weights", ""))

    def served_weights(self, now: float) -> str | None:
        """The weights formats of the verifiers heard (gpu_worker/batching/slots.py resolve_weights:
        which model of the target they compute), comma-separated; None while none is heard."""
        live = sorted({self.weights.get(i, "") for i, b in self.beats.items() if b[1] >= now} - {""})
        return ",".join(live) or None

    def max_model_len(self, now: float) -> int | None:
        self.beats = {i: b for i, b in self.beats.items() if b[1] >= now}
        return min((limit for limit, _ in self.beats.values()), default=None)
