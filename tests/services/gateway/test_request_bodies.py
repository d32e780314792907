"""services/gateway/request_bodies.py: OpenAI bodies mapped to one GenerateRequest per choice, and
what specbus cannot do refused naming the field."""

import pytest
from pydantic import ValidationError

from text.tokenizer import load_tokenizer
from schemas.config import TINY_TARGET
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import DRAFT_METHOD_CHOICES
from services.gateway import messages_api, responses_api
from services.gateway.api_errors import ApiError
from services.gateway.request_bodies import (MAX_CHOICES, MAX_PROMPT_LOGPROB_VALUES, ChatBody, CompletionBody,
                                             SpecbusFields, chat_plans, completion_plans)
from services.gateway.token_texts import TokenTexts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TARGET)


def test_completion_plans_give_n_choices_per_prompt_with_derived_seeds(tokenizer):
    body = CompletionBody(model="m", prompt=[[4, 9], [5, 6]], n=2, seed=7, echo=True, logprobs=1, max_tokens=3)
    plans = completion_plans(body, TokenTexts(tokenizer), timeout_s=30.0)
    assert [p.index for p in plans] == [0, 1, 2, 3]
    assert [p.request.sampling.seed for p in plans] == [7, 8, 7, 8]
    assert plans[2].request.prompt_token_ids.tolist() == [5, 6] and plans[2].echo_text == tokenizer.decode([5, 6])
    assert plans[0].request.logprobs.prompt_logprobs == 1 and plans[0].request.timeout_s == 30.0
    assert CompletionBody(model="m", prompt="a").n == 1
    assert completion_plans(CompletionBody(prompt="a"), TokenTexts(tokenizer), 30.0)[0].request.sampling.max_tokens == 16


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "n"),
    ({"prompt": "a", "top_p": 0.0}, "top_p"),
    ({"prompt": [], "n": 1}, "prompt"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "draft_mode": "sample", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),  # only with stream
    ({"prompt": "a", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),  # vLLM: not in a stream
])
def test_completion_plans_refuse_what_specbus_cannot_do_naming_the_field(tokenizer, body, param):
    with pytest.raises(ApiError) as caught:
        completion_plans(CompletionBody(model="m", **body), TokenTexts(tokenizer), 30.0)
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
    many = ChatBody(model="m", messages=hi, max_completion_tokens=10**6)
    assert chat_plans(many, 99, 30.0)[0].request.sampling.max_tokens == 10**6  # the scheduler's cap decides
    refused = SpecbusError(ErrorCode.invalid_field, "max_tokens 1000000 is above the cap 8", "sampling.max_tokens")
    assert ApiError.from_specbus(refused, many.param_names()).param == "max_completion_tokens"


def test_custom_roles_and_extra_message_fields_are_taken_and_the_template_gets_role_and_content():
    messages = [{"role": "ipython", "content": "42", "tool_call_id": "c1"},  # tool turns: test_tools.py
                {"role": "assistant", "content": None, "tool_calls": [], "name": "bot"},
                {"role": "user", "content": [{"type": "text", "text": "x"}], "name": "ann"}]
    plans = chat_plans(ChatBody(messages=messages), 99, 30.0)
    assert [(m.role, m.content) for m in plans[0].request.messages] == [("ipython", "42"), ("assistant", ""),
                                                                        ("user", "x")]


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "8"), ("n", "2"), ("stream", 1), ("temperature", "0.5"), ("echo", "true"), ("seed", 1.0),
    ("stop_token_ids", ["7"]),
])
def test_types_are_strict_as_openais_server_takes_them(field, value):
    """A value of the wrong JSON type is refused naming the field, never coerced."""
    with pytest.raises(ValidationError) as caught:
        CompletionBody.model_validate({"prompt": "x", field: value})
    assert caught.value.errors()[0]["loc"][0] == field
    assert CompletionBody.model_validate({"prompt": "x", "temperature": 1, "max_tokens": 8}).temperature == 1.0
    with pytest.raises(ValidationError):
        ChatBody.model_validate({"messages": [{"role": "user", "content": 5}]})


def test_timeout_s_zero_is_refused_and_none_takes_the_gateways(tokenizer):
    """0 s would be no time at all: a 400 naming the field, never the default in its place."""
    with pytest.raises(ValidationError) as caught:
        CompletionBody.model_validate({"prompt": "x", "timeout_s": 0})
    assert caught.value.errors()[0]["loc"][0] == "timeout_s"
    with pytest.raises(ValidationError):
        ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "timeout_s": 0})
    assert completion_plans(CompletionBody(prompt="x"), TokenTexts(tokenizer), 30.0)[0].request.timeout_s == 30.0
    assert completion_plans(CompletionBody(prompt="x", timeout_s=0.5), TokenTexts(tokenizer),
                            30.0)[0].request.timeout_s == 0.5


def test_a_response_past_its_prompt_logprob_values_is_refused_naming_the_field(tokenizer):
    """16 prompts of 2000 ids with prompt_logprobs 20 would answer tens of megabytes: refused
    before any work; the same with top-0 on one prompt fits."""
    prompts = [[5 + i] * 2000 for i in range(16)]
    for body, param in [({"prompt": prompts, "prompt_logprobs": 20}, "prompt_logprobs"),
                        ({"prompt": prompts[0], "n": 16, "echo": True, "logprobs": 20}, "logprobs"),
                        ({"prompt": "é" * 4000, "prompt_logprobs": 20}, "prompt_logprobs")]:
        with pytest.raises(ApiError, match=f"above {MAX_PROMPT_LOGPROB_VALUES}") as caught:
            completion_plans(CompletionBody(**body), TokenTexts(tokenizer), 30.0)
        assert caught.value.param == param
    assert len(completion_plans(CompletionBody(prompt=prompts[0], prompt_logprobs=0), TokenTexts(tokenizer), 30.0)) == 1
    with pytest.raises(ApiError) as caught:
        chat_plans(ChatBody(messages=[{"role": "user", "content": "x" * 20000}], n=4, prompt_logprobs=20), 16, 30.0)
    assert caught.value.param == "prompt_logprobs"


SPECBUS = dict(seed=7, top_k=5, min_p=0.1, ignore_eos=True, stop_token_ids=[3], num_speculative_tokens=2,
               draft_mode="sample", draft_method=DRAFT_METHOD_CHOICES[0], coupling="gumbel",
               logprobs_mode="processed", sampling_mask=True, timeout_s=9.0)


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_responses_and_messages_take_every_specbus_field_and_pass_it_on(route):
    assert set(SPECBUS) == set(SpecbusFields.model_fields)

    def chat(**fields):
        if route == "responses":
            return responses_api.chat_body(responses_api.ResponsesBody(input="Hi", **fields), [])[0]
        return messages_api.chat_body(messages_api.MessagesBody(max_tokens=4, messages=[
            {"role": "user", "content": "Hi"}], **fields))

    assert chat(**SPECBUS).specbus_fields() == SPECBUS
    assert chat().specbus_fields() == {}
    with pytest.raises(ValidationError, match="timeout_s"):
        chat(timeout_s=0)
