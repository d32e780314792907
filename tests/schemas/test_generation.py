"""GenerateRequest and its options (schemas/generation.py): nonsense is refused with the error
code and the dotted name of the field; sampling parameters reach the row subset."""

import msgpack
import pytest

from schemas import (PROTOCOL_VERSION, CodecError, ErrorCode, GenerateRequest, SamplingParams, SpecbusError, check_limits,
                     decode, encode, new_request_id, validate)
from schemas.generation import RowSampling, draft_is_sampled


def generate_payload(**overrides) -> bytes:
    """A GenerateRequest as a client library in any language would send it, with overrides."""
    raw = {"v": PROTOCOL_VERSION, "type": "generate", "request_id": "req-1", "prompt": "def f(x):"}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split("__")
        target = raw
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return msgpack.packb(raw, use_bin_type=True)


@pytest.mark.parametrize("overrides, field, message", [
    ({"sampling__temperature": -0.5}, "sampling.temperature", "greater than or equal to 0"),
    ({"sampling__temperature": float("nan")}, "sampling.temperature", "finite"),
    ({"sampling__temperature": float("inf")}, "sampling.temperature", "finite"),
    ({"sampling__top_p": 0.0}, "sampling.top_p", "greater than or equal to 0.000001"),
    # values that pass a float64 check but mean something else in float32
    ({"sampling__temperature": 1e308}, "sampling.temperature", "less than or equal to 100"),
    ({"sampling__temperature": 1e-300}, "sampling.temperature", "temperature must be 0 .greedy. or in .0.01, 100"),
    ({"sampling__top_p": 1e-300}, "sampling.top_p", "greater than or equal to 0.000001"),
    ({"sampling__top_k": 2**63}, "sampling.top_k", "less than or equal to 1048576"),
    ({"sampling__top_p": 1.5}, "sampling.top_p", "less than or equal to 1"),
    ({"sampling__top_p": float("nan")}, "sampling.top_p", "finite"),
    ({"sampling__top_k": -1}, "sampling.top_k", "greater than or equal to 0"),
    ({"sampling__min_p": 1.0}, "sampling.min_p", "less than 1"),
    ({"sampling__max_tokens": -1}, "sampling.max_tokens", "greater than or equal to 0"),
    ({"sampling__max_tokens": 4097}, "sampling.max_tokens", "above the cap 4096"),
    ({"sampling__seed": -1}, "sampling.seed", "greater than or equal to 0"),
    ({"sampling__seed": 2**63}, "sampling.seed", "less than or equal to"),
    ({"sampling__stop": ["ok", ""]}, "sampling.stop[1]", "at least 1 character"),
    ({"sampling__presence_penalty": 2.5}, "sampling.presence_penalty", "less than or equal to 2"),
    ({"sampling__frequency_penalty": -2.5}, "sampling.frequency_penalty", "greater than or equal to -2"),
    ({"sampling__frequency_penalty": float("nan")}, "sampling.frequency_penalty", "finite"),
    ({"sampling__repetition_penalty": 0.0}, "sampling.repetition_penalty", "greater than or equal to 0.01"),
    ({"sampling__repetition_penalty": float("inf")}, "sampling.repetition_penalty", "finite"),
    ({"sampling__logit_bias": {"5": 101}}, "sampling.logit_bias", r"every bias must be in \[-100, 100\]"),
    ({"sampling__logit_bias": {"5": float("nan")}}, "sampling.logit_bias", r"every bias must be in"),
    ({"sampling__logit_bias": {"x": 1}}, "sampling.logit_bias", "'x' is not a token id"),
    ({"sampling__logit_bias": {"-3": 1}}, "sampling.logit_bias", "'-3' is not a token id"),
    ({"sampling__logit_bias": {"5": "ban"}}, "sampling.logit_bias", "the bias of token 5 is not a number"),
    ({"sampling__logit_bias": {str(i): 1 for i in range(301)}}, "sampling.logit_bias", "at most 300 token ids"),
    ({"sampling__logit_bias": {"token_ids": [1, 1], "bias": [1.0, 2.0]}}, "sampling.logit_bias", "appears twice"),
    ({"sampling__logit_bias": {"token_ids": [1, 2], "bias": [1.0]}}, "sampling.logit_bias", "2 token ids for 1"),
    ({"sampling__temprature": 0.7}, "sampling.temprature", "Extra inputs are not permitted"),
    ({"speculative__num_speculative_tokens": -1}, "speculative.num_speculative_tokens", "greater than or equal to 0"),
    ({"speculative__num_speculative_tokens": 17}, "speculative.num_speculative_tokens", "less than or equal to 16"),
    ({"speculative__draft_mode": "beam"}, "speculative.draft_mode", "'greedy' or 'sample'"),
    ({"logprobs__logprobs_mode": "softmax"}, "logprobs.logprobs_mode", "'raw' or 'processed'"),
    ({"logprobs__logprobs": 21}, "logprobs.logprobs", "less than or equal to 20"),
    ({"logprobs__prompt_logprobs": 50}, "logprobs.prompt_logprobs", "less than or equal to 20"),
    ({"logprobs__logprob_token_ids": list(range(65))}, "logprobs.logprob_token_ids", "at most 64"),
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt_token_ids": [1, 2]}, "prompt", "exactly one of prompt and prompt_token_ids"),
    ({"prompt": None}, "prompt", "exactly one of prompt and prompt_token_ids"),
    ({"prompt": None, "prompt_token_ids": []}, "prompt_token_ids", "prompt_token_ids is empty"),
    ({"prompt": None, "prompt_token_ids": [5, -3]}, "prompt_token_ids", "token ids must be >= 0"),
    ({"prompt": None, "prompt_token_ids": [1.5]}, "prompt_token_ids", "expected integers"),
    ({"request_id": ""}, "request_id", "at least 1 character"),
    ({"request_id": "has space"}, "request_id", "pattern"),
    ({"request_id": "x" * 129}, "request_id", "at most 128 characters"),
    ({"timeout_s": 0}, "timeout_s", "greater than 0"),
])
def test_nonsense_generate_request_names_the_field(overrides, field, message):
    with pytest.raises(CodecError, match=message) as caught:
        decode(generate_payload(**overrides), GenerateRequest)
    assert (caught.value.code, caught.value.field) == (ErrorCode.invalid_field, field)


def test_sensible_generate_request_is_accepted():
    request = decode(generate_payload(sampling__temperature=0, sampling__max_tokens=4096,
                                      speculative__num_speculative_tokens=16, logprobs__logprobs=20), GenerateRequest)
    assert request.sampling.greedy
    assert request.speculative.num_speculative_tokens == 16


def test_scheduler_sets_its_own_max_tokens_cap():
    payload = generate_payload(sampling__max_tokens=6000)
    assert decode(payload, GenerateRequest, context={"max_tokens_cap": 8192}).sampling.max_tokens == 6000
    request = decode(generate_payload(sampling__max_tokens=500), GenerateRequest)
    with pytest.raises(SpecbusError, match="max_tokens 500 is above the cap 256") as caught:
        check_limits(request, max_tokens_cap=256)
    assert (caught.value.code, caught.value.field) == (ErrorCode.invalid_field, "sampling.max_tokens")


def test_python_side_validation_names_the_field():
    with pytest.raises(CodecError, match="less than or equal to 1") as caught:
        validate(GenerateRequest, {"request_id": new_request_id(), "prompt": "x", "sampling": {"top_p": 2}})
    assert caught.value.field == "sampling.top_p"


def test_sampling_params_split_into_the_row_subset():
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=7, max_tokens=12, stop=["\n"])
    row = params.row_sampling()
    assert (row.temperature, row.top_k, row.top_p, row.min_p, row.seed) == (0.8, 40, 0.9, 0.05, 7)
    assert not row.greedy


def test_logit_bias_and_penalties_reach_the_row_and_travel_packed():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                            logit_bias={"50256": -100, 7: 2.5})
    row = params.row_sampling()
    assert (row.presence_penalty, row.frequency_penalty, row.repetition_penalty) == (0.5, -1.0, 1.2)
    assert row.logit_bias.as_dict() == {50256: -100.0, 7: 2.5} and row.penalised
    request = GenerateRequest(request_id="r", prompt="x", sampling=params)
    wire = msgpack.unpackb(encode(request), raw=False)["sampling"]["logit_bias"]
    assert set(wire) == {"token_ids", "bias"} and set(wire["token_ids"]) == {"dtype", "shape", "data"}
    assert decode(encode(request), GenerateRequest) == request
    assert SamplingParams(logit_bias={}).logit_bias is None and not SamplingParams().penalised


def test_new_request_ids_are_valid_and_distinct():
    first, second = new_request_id(), new_request_id()
    assert first != second
    assert GenerateRequest(request_id=first, prompt="x").request_id == first


def test_a_draft_is_sampled_unless_greedy_and_gumbel_rows_always_are():
    """The drafter's rule (gpu_worker/drafter/drafter_core.py), which the scheduler sizes draft
    answers by: a Gumbel-coupled row draws its drafts (by the target's noise) whatever its
    draft_mode, a temperature-0 row never does."""
    greedy, sampled = RowSampling(temperature=0.0), RowSampling(temperature=0.8, coupling="rejection")
    coupled = RowSampling(temperature=0.8)
    assert coupled.coupling == "gumbel"  # the default
    assert not draft_is_sampled(greedy, "sample") and not draft_is_sampled(sampled, "greedy")
    assert draft_is_sampled(sampled, "sample") and draft_is_sampled(coupled, "greedy")
