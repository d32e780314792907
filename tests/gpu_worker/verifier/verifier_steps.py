"""The verifier tests' tiny random Llama on disk and a scheduler's loop around verify_batch
(gpu_worker/verifier/verifier_core.py), shared by tests/gpu_worker/verifier/test_verifier_*.py."""

import time

import torch
from gpu_worker.verifier.verifier_core import load_verifier, verify_batch
from schemas.config import VerifierConfig, load_config
from schemas.generation import LogprobOptions, RowSampling
from schemas.steps import Proposal, VerifyRequest, VerifyRow
from tests.tiny_checkpoints import TINY

V = TINY["vocab_size"]
PROMPT = [5, 17, 42, 8, 90, 23, 61, 3, 77, 12, 50, 31, 6]
MAX_SLOTS = 4
SAMPLED = dict(temperature=0.9, top_p=0.8, seed=1234)


def new_verifier(target, **overrides):
    settings = dict(target_model=str(target.path), instance_id="verifier-test", max_slots=MAX_SLOTS,
                    max_seq_len=TINY["max_position_embeddings"], dtype="float32")
    return load_verifier(load_config(VerifierConfig, env={}, **{**settings, **overrides}))


def vrow(request_id, new_token_ids, cached_len=0, drafts=(), step=0, prompt_len=len(PROMPT), emit=True,
         logprobs=None, proposal=None, index=0, cache_salt=None, **sampling):
    return VerifyRow(request_id=request_id, row=index, step=step, cached_len=cached_len,
                     new_token_ids=list(new_token_ids), draft_token_ids=list(drafts),
                     proposal=proposal or Proposal(), sampling=RowSampling(**{"temperature": 0, **sampling}),
                     logprobs=logprobs or LogprobOptions(), postprocessor_id="post-test", prompt_len=prompt_len,
                     emit=emit, cache_salt=cache_salt)


def run(verifier, *rows, release=(), batch_id=1):
    """request_id -> (VerifyResult, SideChannelRecord or None) of one verify_batch."""
    rows = [r.model_copy(update={"row": i}) for i, r in enumerate(rows)]
    request = VerifyRequest(batch_id=batch_id, scheduler_id="sched-test", deadline=time.time() + 30, rows=rows,
                            release=list(release))
    response, records = verify_batch(verifier, request)
    assert [r.request_id for r in response.rows] == [r.request_id for r in rows]
    assert all(post == "post-test" for post, _ in records)
    by_id = {record.request_id: record for _, record in records}
    return {r.request_id: (r, by_id.get(r.request_id)) for r in response.rows}


def one(verifier, row, **kwargs):
    return run(verifier, row, **kwargs)[row.request_id]


def generate(verifier, request_id, prompt, num_tokens, drafts_for=lambda history, k: [], k=0, **row_kwargs):
    """A speculative decoding loop as the scheduler runs it: returns (tokens, records, steps)."""
    history, cached_len, records, steps = list(prompt), 0, [], 0
    while len(history) < len(prompt) + num_tokens:
        drafts = drafts_for(history, k)
        result, record = one(verifier, vrow(request_id, history[cached_len:], cached_len, drafts, step=steps,
                                            prompt_len=len(prompt), **row_kwargs), batch_id=steps)
        assert result.error is None and not result.need_resync
        cached_len += len(history) - cached_len + result.num_accepted
        history += result.token_ids.tolist()
        records.append(record)
        steps += 1
    return history[len(prompt):len(prompt) + num_tokens], records, steps


def hf_logprobs(target, ids):
    """Raw log-softmax [T, V] of a full forward in transformers."""
    with torch.no_grad():
        return target.hf(torch.tensor([ids])).logits[0].log_softmax(-1)


PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3, logit_bias={11: 2.0, 40: -3.0})


def penalised_reference(logits, prompt, output, penalties=PENALTIES):
    """OpenAI's and vLLM's definitions, one token at a time: logits (V,) after prompt + output."""
    logits = logits.clone()
    for token, bias in penalties["logit_bias"].items():
        logits[token] += bias
    for token in set(prompt) | set(output):
        r = penalties["repetition_penalty"]
        logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(output):
        logits[token] -= output.count(token) * penalties["frequency_penalty"] + penalties["presence_penalty"]
    return logits
