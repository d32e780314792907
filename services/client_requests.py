"""Building a GenerateRequest from a prompt (or a chat) and flat options: `make_request`,
`score_request` (re-exported by services/client.py, the client library's API)."""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from schemas.bus.codec import validate
from schemas.errors import CodecError, ErrorCode
from schemas.generation import GenerateRequest, LogprobOptions, SamplingParams, SpeculativeOptions, new_request_id

REQUEST_FIELDS = {"request_id", "timeout_s", "stream"}
GROUPS = {"sampling": SamplingParams, "logprobs": LogprobOptions, "speculative": SpeculativeOptions}


def make_request(prompt: str | Sequence[int] | np.ndarray | None = None, *,
                 messages: Sequence[Mapping[str, str]] | None = None, **options: Any) -> GenerateRequest:
    """A GenerateRequest from a prompt (text, or token ids) or a chat (messages=[{"role": "user",
    "content": ...}, ...]: the scheduler applies the target's chat template, and generation stops
    at its end-of-turn token, the model's EOS) and flat options: any field of
    SamplingParams (max_tokens, temperature, top_k, top_p, min_p, seed, stop, stop_token_ids,
    ignore_eos, the penalties, logit_bias, coupling), LogprobOptions (logprobs, prompt_logprobs,
    logprobs_mode, logprob_token_ids, sampling_mask, max_mask_size), SpeculativeOptions
    (num_speculative_tokens, draft_mode, draft_method),
    and request_id, timeout_s, stream. Options given as None keep their defaults.
    Raises CodecError naming the field (e.g. "sampling.top_p") for a bad value or name.
    """
    raw: dict[str, Any] = {"request_id": new_request_id(), **{group: {} for group in GROUPS}}
    if messages is not None:
        raw["messages"] = [dict(message) for message in messages]
    if isinstance(prompt, str):
        raw["prompt"] = prompt
    elif prompt is not None:
        raw["prompt_token_ids"] = np.asarray(prompt)
    for name, value in options.items():
        if value is None:
            continue
        group = next((g for g, model in GROUPS.items() if name in model.model_fields), None)
        if group is not None:
            raw[group][name] = value
        elif name in REQUEST_FIELDS:
            raw[name] = value
        else:
            raise CodecError(ErrorCode.invalid_field, f"unknown request option {name!r}", name)
    # no max_tokens cap here: the scheduler's (its max_tokens_cap and the verifiers' max_seq_len) decides
    return validate(GenerateRequest, raw, context={"max_tokens_cap": None})


def score_request(prompt: str | Sequence[int] | np.ndarray, prompt_logprobs: int = 0,
                  **options: Any) -> GenerateRequest:
    """A request that generates nothing and returns the logprob of every prompt token
    (max_tokens=0 with prompt_logprobs): scores a sequence."""
    return make_request(prompt, max_tokens=0, prompt_logprobs=prompt_logprobs, **options)
