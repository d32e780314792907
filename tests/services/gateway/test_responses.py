"""services/gateway/responses.py: StreamChunks as OpenAI choices, usage, logprobs and prompt
logprobs in OpenAI's and vLLM's shapes (the HTTP side is tests/system/api/test_gateway.py)."""

import json

import numpy as np
import pytest

from text.tokenizer import load_tokenizer
from schemas.config import TINY_TARGET
from schemas.streams import StreamChunk, TokenLogprob, Usage
from services.gateway.api_errors import ApiError
from services.gateway.request_bodies import CompletionBody, completion_plans
from services.gateway.responses import NEG_INF_LOGPROB, Choice, VerifierLimits, merge_pieces, speculation_json, usage_json
from services.gateway.token_texts import TokenTexts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TARGET)


def chunk(seq, ids, *, final=None, logprobs=True, **fields):
    entries = [TokenLogprob(token_id=i, logprob=-0.5 * (k + 1), top_ids=np.array([i, 7]),
                            top_logprobs=np.array([-0.5 * (k + 1), float("-inf")])) for k, i in enumerate(ids)]
    return StreamChunk(request_id="r", seq=seq, token_ids=np.array(ids), text="".join(f"<{i}>" for i in ids),
                       from_draft=[False] * len(ids), logprobs=entries if logprobs else None, finish_reason=final,
                       usage=Usage(prompt_tokens=3, completion_tokens=len(ids), draft_tokens_proposed=4,
                                   draft_tokens_accepted=2, steps=1, speculative_lengths=[0, 0, 0, 0, 1])
                       if final else None, **fields)


def test_completion_pieces_carry_openai_logprobs_offsets_and_degraded(tokenizer):
    choice = Choice(0, TokenTexts(tokenizer), top_n=1)
    ids = tokenizer.encode("ab cd")
    first = choice.completion_piece(chunk(0, ids[:1], degraded=["draft_timeout"]))
    last = choice.completion_piece(chunk(1, ids[1:], final="eos"))
    assert first["finish_reason"] is None and last["finish_reason"] == "stop"
    assert first["degraded"] == ["draft_timeout"] and "degraded" not in last
    merged = merge_pieces("completion", [first, last])
    assert merged["degraded"] == ["draft_timeout"] and merged["finish_reason"] == "stop"
    tokens = [tokenizer.decode([i]) for i in ids]
    assert merged["logprobs"]["tokens"] == tokens
    assert merged["logprobs"]["text_offset"] == [sum(len(t) for t in tokens[:k]) for k in range(len(ids))]
    assert merged["logprobs"]["top_logprobs"][0] == {tokens[0]: -0.5}
    assert usage_json([choice], n=1) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                         "prompt_tokens_details": {"audio_tokens": 0, "cached_tokens": 0},
                                         "completion_tokens_details": {"accepted_prediction_tokens": 2,
                                                                       "audio_tokens": 0, "reasoning_tokens": 0,
                                                                       "rejected_prediction_tokens": 2}}
    assert speculation_json([choice]) == {"draft_tokens_proposed": 4, "draft_tokens_accepted": 2,
                                          "acceptance_rate": 0.5, "steps": 1, "speculative_lengths": [0, 0, 0, 0, 1]}
    other = Choice(1, TokenTexts(tokenizer), top_n=1)
    other.finish(StreamChunk(request_id="s", seq=0, finish_reason="length", usage=Usage(steps=3,
                                                                                    speculative_lengths=[2, 1])))
    assert speculation_json([choice, other])["speculative_lengths"] == [2, 1, 0, 0, 1]  # summed per k


def test_chat_logprobs_write_minus_infinity_as_a_finite_number(tokenizer):
    choice = Choice(0, TokenTexts(tokenizer), top_n=2)
    piece = choice.chat_piece(chunk(0, [tokenizer.encode("x")[0]], final="length"), delta=False)
    entry = piece["logprobs"]["content"][0]
    assert entry["token"] == "x" and entry["bytes"] == [ord("x")] and entry["logprob"] == -0.5
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, NEG_INF_LOGPROB]
    assert piece["message"] == {"role": "assistant", "content": piece["message"]["content"]}
    json.dumps(piece, allow_nan=False)


def test_a_timed_out_request_is_a_504_and_usage_counts_each_prompt_once(tokenizer):
    with pytest.raises(ApiError) as caught:
        Choice(0, TokenTexts(tokenizer), None).completion_piece(chunk(0, [], final="timeout"))
    assert caught.value.status == 504
    choices = [Choice(i, TokenTexts(tokenizer), None) for i in range(4)]
    for c in choices:
        c.completion_piece(chunk(0, [1, 2], final="length"))
    usage = usage_json(choices, n=2)  # 2 prompts x 2 choices
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (6, 8, 14)


def test_echoed_prompt_ids_are_their_tokens_text_and_offsets_agree_with_it(tokenizer):
    """Special tokens included (the echoed prompt keeps them; generated text leaves them out,
    so there they take no room), and a character split across tokens begins in the first."""
    texts = TokenTexts(tokenizer)
    eos = tokenizer.eos_ids[0]
    prompt = [eos, eos, *tokenizer.encode("é€ x")]
    body = CompletionBody(prompt=prompt, echo=True, logprobs=0, max_tokens=4)
    [plan] = completion_plans(body, texts, 30.0)
    assert plan.echo_text == texts.join(prompt) == "<|endoftext|><|endoftext|>é€ x"
    choice = Choice(0, texts, top_n=0, echo_text=plan.echo_text)
    euro, tail = tokenizer.encode("-€"), [eos, *tokenizer.encode("y")]
    assert any("\ufffd" in texts.text(i) for i in euro)  # the tokenizer splits the character
    first = chunk(0, euro, prompt_token_ids=np.array(prompt), prompt_logprobs=[None] * len(prompt))
    last = chunk(1, tail, final="length")
    pieces = [choice.completion_piece(first.model_copy(update={"text": "-€"})),
              choice.completion_piece(last.model_copy(update={"text": "y"}))]
    merged = merge_pieces("completion", pieces)
    text, tokens, offsets = merged["text"], merged["logprobs"]["tokens"], merged["logprobs"]["text_offset"]
    assert text == "<|endoftext|><|endoftext|>é€ x-€y"
    ids = [*prompt, *euro, *tail]
    spans = [text[start:end] for start, end in zip(offsets, offsets[1:] + [len(text)])]
    assert "".join(spans) == text
    for position, (token_id, token, span) in enumerate(zip(ids, tokens, spans)):
        if position >= len(prompt) and token_id == eos:
            assert span == ""  # a generated special token is not in the text
        elif "\ufffd" not in token:
            assert span == token, (position, token, span)


def test_prompt_logprobs_have_vllms_shape(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("ab cd")
    entries = [None] + [TokenLogprob(token_id=i, logprob=-1.0, rank=3, top_ids=np.array([7, 8]),
                                     top_logprobs=np.array([-0.5, float("-inf")])) for i in ids[1:]]
    choice = Choice(0, texts, top_n=None, prompt_top_n=1)
    piece = choice.completion_piece(chunk(0, [], final="length", logprobs=False,
                                          prompt_token_ids=np.array(ids), prompt_logprobs=entries))
    scored = piece["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    assert scored[1] == {"7": {"logprob": -0.5, "rank": 1, "decoded_token": texts.text(7)},
                         str(ids[1]): {"logprob": -1.0, "rank": 3, "decoded_token": texts.text(ids[1])}}
    assert merge_pieces("completion", [piece])["prompt_logprobs"] == scored
    body = CompletionBody(prompt="a", echo=True, logprobs=2, prompt_logprobs=4)
    assert completion_plans(body, texts, 30.0)[0].request.logprobs.prompt_logprobs == 4
    assert body.param_names() == {"prompt_token_ids": "prompt"}


def test_max_model_len_is_the_smallest_live_verifiers():
    from types import SimpleNamespace

    def beat(instance_id, limit, role="verifier"):
        return SimpleNamespace(instance_id=instance_id, role=role, model_ids={"max_seq_len": str(limit)},
                               interval_s=1.0)

    limits = VerifierLimits()
    assert limits.max_model_len(now=0.0) is None
    limits.observe(beat("v0", 2048), now=0.0)
    limits.observe(beat("v1", 1024), now=1.0)
    limits.observe(beat("d0", 64, role="drafter"), now=1.0)
    assert limits.max_model_len(now=2.0) == 1024
    assert limits.max_model_len(now=3.5) == 1024 and limits.max_model_len(now=4.5) is None  # 3 intervals silent


def test_v1_models_names_the_weights_the_live_verifiers_compute():
    from types import SimpleNamespace

    def beat(instance_id, weights):
        return SimpleNamespace(instance_id=instance_id, role="verifier", interval_s=1.0,
                               model_ids={"max_seq_len": "2048", "weights": weights})

    limits = VerifierLimits()
    assert limits.served_weights(now=0.0) is None
    limits.observe(beat("v0", "int8dot"), now=0.0)
    assert limits.served_weights(now=1.0) == "int8dot"
    limits.observe(beat("v1", "gguf"), now=1.0)
    assert limits.served_weights(now=2.0) == "gguf,int8dot"
    assert limits.served_weights(now=3.5) == "gguf"  # v0 silent three intervals
