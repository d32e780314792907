"""services/gateway/api_errors.py: pydantic's, specbus's and the framework's errors as OpenAI error
objects naming the body's field by its full path, clipped."""

import pytest
from pydantic import ValidationError

from schemas.errors import ErrorCode, SpecbusError
from services.gateway.api_errors import (MAX_MESSAGE_CHARS, ApiError, clip, content_type_error, framework_error,
                                         validation_error)
from services.gateway.request_bodies import ChatBody, CompletionBody


def errors_of(model, body):
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return validation_error([dict(e, loc=("body", *e["loc"])) for e in caught.value.errors()])  # as FastAPI has them


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "temperature": 0, "best_of": 2, "frequency_penalty": "high"}, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": "ban"}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "tools": []}, "tools"),
    ({"model": "m", "prompt": {"text": "x"}}, "prompt"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m"}, "prompt"),
])
def test_a_bad_completion_body_names_the_field(body, param):
    error = errors_of(CompletionBody, body)
    assert (error.status, error.param) == (400, param) and error.message.startswith(param)


def test_a_bad_chat_message_names_its_index_and_field():
    error = errors_of(ChatBody, {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": ""}]})
    assert error.param == "messages[1].role"
    assert errors_of(ChatBody, {"model": "m", "messages": []}).param == "messages"
    assert errors_of(ChatBody, {"messages": [{"role": "r" * 65, "content": "x"}]}).param == "messages[0].role"
    assert errors_of(ChatBody, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).param \
        .startswith("messages[0].content")


def test_specbus_errors_map_to_statuses_and_the_bodys_names():
    error = ApiError.from_specbus(SpecbusError(ErrorCode.invalid_field, "bad", "logprobs.logprobs"),
                                  {"logprobs": "top_logprobs"})
    assert (error.status, error.param, error.type) == (400, "top_logprobs", "invalid_request_error")
    statuses = {code: ApiError.from_specbus(SpecbusError(code, "m")).status for code in ErrorCode}
    assert statuses[ErrorCode.overloaded] == 429 and statuses[ErrorCode.unavailable] == 503
    assert statuses[ErrorCode.timeout] == 504 and statuses[ErrorCode.not_found] == 404
    assert ApiError(401, "no").to_json() == {"error": {"message": "no", "type": "invalid_request_error",
                                                       "param": None, "code": None}}


def test_echoed_inputs_and_whole_messages_are_clipped():
    assert clip("m" * 8_000_000) == "m" * 64 + "... (8000000 characters)"
    error = ApiError(404, "x" * 10_000, param="p" * 10_000)
    assert len(error.message) < MAX_MESSAGE_CHARS + 30 and len(error.param) < 200
    named = validation_error([{"type": "extra_forbidden", "loc": ("body", "k" * 1000), "msg": "Extra inputs"}])
    assert len(named.message) < 200


def test_framework_errors_and_unparsable_bodies_are_openai_errors():
    assert framework_error(404, "GET", "/v1/nothing").to_json()["error"] == {
        "message": "no such route: GET /v1/nothing", "type": "not_found_error", "param": None, "code": "not_found"}
    assert framework_error(405, "DELETE", "/v1/models", "GET").code == "method_not_allowed"
    assert framework_error(400, "POST", "/v1/completions").code == "invalid_json"
    error = validation_error([{"type": "json_invalid", "loc": ("body", 12), "msg": "JSON decode error",
                               "ctx": {"error": "Expecting value"}}])
    assert (error.status, error.param, error.code) == (400, None, "invalid_json") and "character 12" in error.message


@pytest.mark.parametrize("field, names, param", [
    ("messages[0].content", {}, "messages[0].content"),  # a lone surrogate in a chat message
    ("sampling.stop[1]", {}, "stop[1]"),
    ("sampling.top_p", {}, "top_p"),
    ("prompt_token_ids[3]", {"prompt_token_ids": "prompt"}, "prompt[3]"),
    ("logprobs.logprobs", {"logprobs": "top_logprobs"}, "top_logprobs"),
    ("sampling.max_tokens", {"max_tokens": "max_completion_tokens"}, "max_completion_tokens"),
])
def test_a_specbus_error_names_the_full_path_as_the_body_spells_it(field, names, param):
    error = ApiError.from_specbus(SpecbusError(ErrorCode.invalid_field, "bad", field), names)
    assert (error.param, error.message) == (param, f"{param}: bad")


@pytest.mark.parametrize("cause, words", [
    (RecursionError("maximum recursion depth exceeded"), "nested too deeply"),
    (ValueError("Exceeds the limit (4300 digits) for integer string conversion"), "4300 digits"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "UTF-8"),
])
def test_a_body_json_cannot_read_is_invalid_json_saying_why(cause, words):
    error = framework_error(400, "POST", "/v1/completions", cause=cause)
    assert (error.status, error.code) == (400, "invalid_json") and words in error.message
    if not isinstance(cause, UnicodeDecodeError):
        assert "UTF-8" not in error.message


def test_an_empty_body_is_invalid_json_and_a_body_of_another_content_type_a_415():
    error = validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    assert (error.status, error.code, error.param) == (400, "invalid_json", None) and "empty" in error.message
    refused = content_type_error("text/plain; charset=utf-8")
    assert (refused.status, refused.code) == (415, "unsupported_media_type") and "application/json" in refused.message
    assert content_type_error("application/json") is None and content_type_error(None) is None
    assert content_type_error("application/vnd.api+json") is None
