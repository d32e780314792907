"""The gateway's NATS-free logic: bodies and their mapping, errors, keys, chat templates, token
texts and the response shapes built from StreamChunks (the HTTP side is tests/test_gateway.py)."""

import json

import numpy as np
import pytest
from pydantic import ValidationError

from gpu_worker.tokenizer import load_tokenizer
from schemas.config import TINY_TARGET
from schemas.errors import ErrorCode, SpecbusError
from schemas.messages import StreamChunk, TokenLogprob, Usage
from services.gateway.gateway_core import MAX_CHOICES, NEG_INF_LOGPROB, ApiError, ChatBody, Choice, CompletionBody, Login, TokenTexts, chat_plans, completion_plans, gateway_logins, merge_pieces, usage_json, user_for_key, validation_error
from services.runtime.auth import api_key_env, generate_api_keys


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TARGET)


def errors_of(model, body):
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return validation_error([dict(e, loc=("body", *e["loc"])) for e in caught.value.errors()])  # as FastAPI has them


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "temperature": 0, "best_of": 2, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "tools": []}, "tools"),
    ({"model": "m", "prompt": {"text": "x"}}, "prompt"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m"}, "prompt"),
])
def test_a_bad_completion_body_names_the_field(body, param):
    error = errors_of(CompletionBody, body)
    assert (error.status, error.param) == (400, param) and error.message.startswith(param)


def test_a_bad_chat_message_names_its_index_and_field():
    error = errors_of(ChatBody, {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "x"}]})
    assert error.param == "messages[1].role"
    assert errors_of(ChatBody, {"model": "m", "messages": []}).param == "messages"


def test_specbus_errors_map_to_statuses_and_the_bodys_names():
    error = ApiError.from_specbus(SpecbusError(ErrorCode.invalid_field, "bad", "logprobs.logprobs"),
                                  {"logprobs": "top_logprobs"})
    assert (error.status, error.param, error.type) == (400, "top_logprobs", "invalid_request_error")
    statuses = {code: ApiError.from_specbus(SpecbusError(code, "m")).status for code in ErrorCode}
    assert statuses[ErrorCode.overloaded] == 429 and statuses[ErrorCode.unavailable] == 503
    assert statuses[ErrorCode.timeout] == 504 and statuses[ErrorCode.not_found] == 404
    assert ApiError(401, "no").to_json() == {"error": {"message": "no", "type": "invalid_request_error",
                                                       "param": None, "code": None}}


def test_completion_plans_give_n_choices_per_prompt_with_derived_seeds(tokenizer):
    body = CompletionBody(model="m", prompt=[[4, 9], [5, 6]], n=2, seed=7, echo=True, logprobs=1, max_tokens=3)
    plans = completion_plans(body, tokenizer, timeout_s=30.0)
    assert [p.index for p in plans] == [0, 1, 2, 3]
    assert [p.request.sampling.seed for p in plans] == [7, 8, 7, 8]
    assert plans[2].request.prompt_token_ids.tolist() == [5, 6] and plans[2].echo_text == tokenizer.decode([5, 6])
    assert plans[0].request.logprobs.prompt_logprobs == 1 and plans[0].request.timeout_s == 30.0
    assert CompletionBody(model="m", prompt="a").n == 1
    assert completion_plans(CompletionBody(model="m", prompt="a"), tokenizer, 30.0)[0].request.sampling.max_tokens == 16


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "n"),
    ({"prompt": "a", "top_p": 0.0}, "top_p"),
    ({"prompt": [], "n": 1}, "prompt"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "draft_mode": "sample", "num_speculative_tokens": 17}, "num_speculative_tokens"),
])
def test_completion_plans_refuse_what_specbus_cannot_do_naming_the_field(tokenizer, body, param):
    with pytest.raises(ApiError) as caught:
        completion_plans(CompletionBody(model="m", **body), tokenizer, 30.0)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_chat_plans_send_the_messages_and_map_max_completion_tokens_and_top_logprobs():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}]
    body = ChatBody(model="m", messages=messages, max_completion_tokens=5, logprobs=True, top_logprobs=3, n=2)
    plans = chat_plans(body, default_max_tokens=99, timeout_s=30.0)
    request = plans[1].request
    assert [(m.role, m.content) for m in request.messages] == [("system", "S"), ("user", "ab")]
    assert (request.sampling.max_tokens, request.logprobs.logprobs, plans[1].index) == (5, 3, 1)
    hi = [{"role": "user", "content": "hi"}]
    assert chat_plans(ChatBody(model="m", messages=hi), 99, 30.0)[0].request.sampling.max_tokens == 99
    with pytest.raises(ApiError) as caught:
        chat_plans(ChatBody(model="m", messages=hi, top_logprobs=2), 99, 30.0)
    assert caught.value.param == "top_logprobs"
    with pytest.raises(ApiError) as caught:
        chat_plans(ChatBody(model="m", messages=hi, max_completion_tokens=10**6), 99, 30.0)
    assert caught.value.param == "max_completion_tokens"


def test_api_keys_come_from_the_environment_and_are_checked(monkeypatch):
    keys = generate_api_keys(["alice", "bob-2"])
    assert set(keys) == {"SPECBUS_ALICE_API_KEY", "SPECBUS_BOB_2_API_KEY"} and api_key_env("bob-2") in keys
    env = {"SPECBUS_CLIENT_USERS": "alice,bob-2", "SPECBUS_ALICE_NATS_PASSWORD": "p1",
           "SPECBUS_BOB_2_NATS_PASSWORD": "p2", **keys}
    logins = gateway_logins(env)
    assert [(login.user, login.password) for login in logins] == [("alice", "p1"), ("bob-2", "p2")]
    assert user_for_key(logins, f"Bearer {keys['SPECBUS_BOB_2_API_KEY']}") == "bob-2"
    for header in (None, "", "Bearer ", "Basic abc", f"Bearer {keys['SPECBUS_ALICE_API_KEY']}x"):
        with pytest.raises(ApiError) as caught:
            user_for_key(logins, header)
        assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    with pytest.raises(SpecbusError) as caught:
        gateway_logins({k: v for k, v in env.items() if k != "SPECBUS_BOB_2_API_KEY"})
    assert caught.value.field == "SPECBUS_BOB_2_API_KEY"
    assert user_for_key([Login("a", "p", "k")], "bearer k") == "a"


def test_token_texts_keep_the_exact_bytes_of_a_split_character(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("é€")
    raw = b"".join(texts.get(i)[0] for i in ids)
    assert raw == "é€".encode()
    assert all(texts.text(i) == tokenizer.decode([i]) for i in tokenizer.encode("def main():\n    return 1"))
    assert texts.text(tokenizer.eos_ids[0]) == "<|endoftext|>"


def chunk(seq, ids, *, final=None, logprobs=True, **fields):
    entries = [TokenLogprob(token_id=i, logprob=-0.5 * (k + 1), top_ids=np.array([i, 7]),
                            top_logprobs=np.array([-0.5 * (k + 1), float("-inf")])) for k, i in enumerate(ids)]
    return StreamChunk(request_id="r", seq=seq, token_ids=np.array(ids), text="".join(f"<{i}>" for i in ids),
                       from_draft=[False] * len(ids), logprobs=entries if logprobs else None, finish_reason=final,
                       usage=Usage(prompt_tokens=3, completion_tokens=len(ids), draft_tokens_proposed=4,
                                   draft_tokens_accepted=2, steps=1) if final else None, **fields)


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
    assert usage_json([choice], n=1)["acceptance_rate"] == 0.5


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
