"""The verifier's step logic (gpu_worker/roles/verifier_core.py) on a tiny random Llama written to disk."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from gpu_worker.roles.slots import evict_idle, instance_heartbeat
from gpu_worker.roles.verifier_core import load_verifier, verify_batch
from schemas.config import VerifierConfig, load_config
from schemas.errors import ErrorCode
from schemas.generation import LogprobOptions, RowSampling
from schemas.steps import Proposal, VerifyRequest, VerifyRow
from tests.tiny_checkpoints import TINY, write_hf_model

V = TINY["vocab_size"]
PROMPT = [5, 17, 42, 8, 90, 23, 61, 3, 77, 12, 50, 31, 6]
MAX_SLOTS = 4
SAMPLED = dict(temperature=0.9, top_p=0.8, seed=1234)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf = write_hf_model(path, "llama", seed=5)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return SimpleNamespace(path=path, hf=hf)


def new_verifier(target, **overrides):
    settings = dict(target_model=str(target.path), instance_id="verifier-test", max_slots=MAX_SLOTS,
                    max_seq_len=TINY["max_position_embeddings"], dtype="float32")
    return load_verifier(load_config(VerifierConfig, env={}, **{**settings, **overrides}))


def vrow(request_id, new_token_ids, cached_len=0, drafts=(), step=0, prompt_len=len(PROMPT), emit=True,
         logprobs=None, proposal=None, index=0, **sampling):
    return VerifyRow(request_id=request_id, row=index, step=step, cached_len=cached_len,
                     new_token_ids=list(new_token_ids), draft_token_ids=list(drafts),
                     proposal=proposal or Proposal(), sampling=RowSampling(**{"temperature": 0, **sampling}),
                     logprobs=logprobs or LogprobOptions(), postprocessor_id="post-test", prompt_len=prompt_len,
                     emit=emit)


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


@pytest.fixture(scope="module")
def greedy_tokens(target):
    """The target's plain greedy continuation of PROMPT, one token per step (k = 0)."""
    tokens, _, steps = generate(new_verifier(target), "plain", PROMPT, 16)
    assert steps == 16
    return tokens


def hf_logprobs(target, ids):
    """Raw log-softmax [T, V] of a full forward in transformers."""
    with torch.no_grad():
        return target.hf(torch.tensor([ids])).logits[0].log_softmax(-1)


# --- greedy -------------------------------------------------------------------------------------


def test_drafts_equal_to_the_greedy_continuation_are_all_accepted_plus_bonus(target, greedy_tokens):
    verifier = new_verifier(target)
    result, _ = one(verifier, vrow("a", PROMPT, drafts=greedy_tokens[:4]))
    assert result.token_ids.tolist() == greedy_tokens[:5]
    assert (result.num_draft, result.num_accepted) == (4, 4)
    # the bonus token is emitted, not cached: the slot holds the prompt and the 4 accepted drafts
    assert int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot]) == len(PROMPT) + 4


def test_wrong_draft_is_rejected_at_the_first_mismatch(target, greedy_tokens):
    verifier = new_verifier(target)
    wrong = (greedy_tokens[2] + 1) % V
    result, _ = one(verifier, vrow("a", PROMPT, drafts=[*greedy_tokens[:2], wrong, greedy_tokens[3]]))
    assert result.token_ids.tolist() == greedy_tokens[:3]  # two accepted, then the target's own token
    assert (result.num_draft, result.num_accepted) == (4, 2)
    assert int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot]) == len(PROMPT) + 2


def test_speculative_decoding_equals_plain_decoding_token_by_token(target, greedy_tokens):
    def drafts_for(history, k):  # right drafts with every third one wrong
        position = len(history) - len(PROMPT)
        right = greedy_tokens[position:position + k]
        return [t if (position + i) % 3 else (t + 7) % V for i, t in enumerate(right)]

    rng_state = torch.get_rng_state()
    tokens, _, steps = generate(new_verifier(target), "spec", PROMPT, 16, drafts_for, k=4)
    assert tokens == greedy_tokens
    assert steps < 16
    assert torch.equal(torch.get_rng_state(), rng_state)  # the global RNG is never touched


# --- batching, retries, resync, release ----------------------------------------------------------


def test_a_row_gives_the_same_tokens_and_logprobs_alone_and_in_a_mixed_batch(target, greedy_tokens):
    options = LogprobOptions(logprobs=3, logprob_token_ids=[1, 2], sampling_mask=True)
    greedy_row = vrow("g", PROMPT, drafts=greedy_tokens[:3], logprobs=options)
    sampled_row = vrow("s", PROMPT[:7], drafts=[4, 9], prompt_len=7, logprobs=options, **SAMPLED)
    alone = {**run(new_verifier(target), greedy_row), **run(new_verifier(target), sampled_row)}

    verifier = new_verifier(target)
    one(verifier, vrow("d", PROMPT[:9], prompt_len=9))  # a request already decoding
    long_prompt = (PROMPT * 5)[:60]
    together = run(verifier, vrow("long", long_prompt, prompt_len=60), sampled_row,
                   vrow("d", [7], cached_len=9, drafts=[3, 3], prompt_len=9, step=1), greedy_row)
    for request_id in ("g", "s"):
        (result, record), (result_b, record_b) = alone[request_id], together[request_id]
        assert result == result_b
        assert record.token_ids.tolist() == record_b.token_ids.tolist() == result.token_ids.tolist()
        assert record.masks == record_b.masks
        for name in ("token_logprobs", "top_logprobs", "requested_logprobs"):
            np.testing.assert_allclose(getattr(record.logprobs, name), getattr(record_b.logprobs, name), atol=1e-5)
        assert np.array_equal(record.logprobs.top_ids, record_b.logprobs.top_ids)


def test_a_retried_step_returns_the_stored_answer_and_appends_nothing(target):
    verifier = new_verifier(target)
    first = one(verifier, vrow("a", PROMPT, drafts=[1, 2], logprobs=LogprobOptions(logprobs=2), **SAMPLED))
    length = int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot])
    retried = one(verifier, vrow("a", PROMPT, drafts=[1, 2], logprobs=LogprobOptions(logprobs=2), **SAMPLED)
                  .model_copy(update={"is_retry": True}))
    assert retried[0] == first[0] and retried[1] == first[1]  # the side record is published again
    assert int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot]) == length
    assert verifier.counters["retries_answered"] == 1


def test_cached_len_mismatch_answers_need_resync_and_changes_nothing(target):
    verifier = new_verifier(target)
    unknown, _ = one(verifier, vrow("new", PROMPT[3:], cached_len=3))
    assert unknown.need_resync and len(unknown.token_ids) == 0 and ("sched-test", "new") not in verifier.requests
    one(verifier, vrow("a", PROMPT[:5], emit=False))
    ahead, _ = one(verifier, vrow("a", PROMPT[8:], cached_len=8, step=1))
    assert ahead.need_resync and len(ahead.token_ids) == 0
    assert int(verifier.cache.lengths[verifier.requests[("sched-test", "a")].slot]) == 5
    # the scheduler then resends the whole history from 0
    assert len(one(verifier, vrow("a", PROMPT, step=2))[0].token_ids) == 1


def test_release_and_idle_eviction_free_slots(target):
    verifier = new_verifier(target)
    run(verifier, vrow("a", PROMPT), vrow("b", PROMPT[:4], prompt_len=4))
    assert verifier.cache.num_free == MAX_SLOTS - 2
    run(verifier, release=["a", "never-seen"])
    assert ("sched-test", "a") not in verifier.requests and verifier.cache.num_free == MAX_SLOTS - 1
    assert verifier.counters["release_unknown"] == 1
    assert evict_idle(verifier, now=time.monotonic() + verifier.slot_idle_ttl_s + 1) == 1
    assert verifier.cache.num_free == MAX_SLOTS and not verifier.requests


def test_a_full_cache_fails_only_the_new_row(target):
    verifier = new_verifier(target, max_slots=1)
    results = run(verifier, vrow("a", PROMPT), vrow("b", PROMPT))
    assert results["a"][0].error is None and len(results["a"][0].token_ids) == 1
    assert results["b"][0].error.code == ErrorCode.no_capacity


def test_short_kv_memory_refuses_the_new_row_overloaded_and_heartbeats_say_so(target):
    # one slot of the tiny target (max_seq_len 128, rounded up to a whole key block of 256) is 257
    # positions of 320 bytes (256 of keys and values, 64 of the bf16 feature row): the budget holds
    # two, the third would eat the headroom kept for growth
    verifier = new_verifier(target, kv_cache_memory="185000")
    slot_bytes = verifier.cache.slot_bytes(1)
    assert slot_bytes == 257 * 320 and verifier.cache.memory_bytes == 185000 and verifier.cache.nbytes == 0
    results = run(verifier, vrow("a", PROMPT), vrow("b", PROMPT), vrow("c", PROMPT))
    assert results["a"][0].error is None and results["b"][0].error is None
    error = results["c"][0].error
    assert error.code == ErrorCode.overloaded and "KV cache memory budget 185000 bytes is short" in error.message
    assert verifier.cache.nbytes == 2 * slot_bytes and verifier.counters["refused_memory"] == 1
    beat = instance_heartbeat(verifier, "verifier", 0.5)
    assert (beat.capacity, beat.load, beat.free_slots, verifier.cache.num_free) == (MAX_SLOTS, 2, 0, MAX_SLOTS - 2)
    results = run(verifier, vrow("c", PROMPT), release=["a"])
    assert results["c"][0].error is None and verifier.cache.nbytes == 2 * slot_bytes


# --- chunked prefill and prompt logprobs ---------------------------------------------------------


def test_prefill_in_chunks_equals_one_shot_prefill(target, greedy_tokens):
    options = LogprobOptions(logprobs=2, prompt_logprobs=4)
    one_shot, one_shot_record = one(new_verifier(target), vrow("a", PROMPT, drafts=greedy_tokens[:2],
                                                                logprobs=options))
    verifier = new_verifier(target, prefill_chunk=3)  # and chunks inside each step
    first, record = one(verifier, vrow("a", PROMPT[:4], emit=False, logprobs=options))
    assert len(first.token_ids) == 0 and record is None  # prompt logprobs wait for the last chunk
    one(verifier, vrow("a", PROMPT[4:9], cached_len=4, emit=False, logprobs=options, step=1))
    chunked, chunked_record = one(verifier, vrow("a", PROMPT[9:], cached_len=9, drafts=greedy_tokens[:2],
                                                 logprobs=options, step=2))
    assert chunked.token_ids.tolist() == one_shot.token_ids.tolist() == greedy_tokens[:3]
    assert chunked.num_accepted == one_shot.num_accepted == 2
    prompt, prompt_b = one_shot_record.prompt_logprobs, chunked_record.prompt_logprobs
    assert one_shot_record.prompt_offset == chunked_record.prompt_offset == 1 and prompt.n == len(PROMPT) - 1
    for name in ("token_logprobs", "top_logprobs"):
        np.testing.assert_allclose(getattr(prompt, name), getattr(prompt_b, name), atol=1e-5)
    assert np.array_equal(prompt.top_ids, prompt_b.top_ids) and np.array_equal(prompt.ranks, prompt_b.ranks)
    np.testing.assert_allclose(prompt.token_logprobs,
                               hf_logprobs(target, PROMPT)[torch.arange(len(PROMPT) - 1), PROMPT[1:]], atol=1e-4)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_prompt_logprobs_equal_the_logprobs_emitted_while_generating(target, greedy_tokens, mode):
    options = LogprobOptions(logprobs=3, prompt_logprobs=3, logprobs_mode=mode, logprob_token_ids=[0, 11])

    def drafts_for(history, k):
        position = len(history) - len(PROMPT)
        return greedy_tokens[position:position + k]

    tokens, records, _ = generate(new_verifier(target), "gen", PROMPT, 10, drafts_for, k=3, logprobs=options,
                                  **SAMPLED)
    emitted = [record.logprobs for record in records]
    generated = {name: np.concatenate([getattr(a, name) for a in emitted])[:10]
                 for name in ("token_logprobs", "top_ids", "top_logprobs", "requested_logprobs", "ranks")}
    assert np.isfinite(generated["token_logprobs"]).all()  # every emitted token is inside its K

    sequence = PROMPT + tokens
    _, scored = one(new_verifier(target), vrow("score", sequence, prompt_len=len(sequence), logprobs=options,
                                               **SAMPLED))
    prompt = scored.prompt_logprobs
    assert scored.prompt_offset == 1 and prompt.n == len(sequence) - 1
    rows = slice(len(PROMPT) - 1, None)  # prompt position p sits at row p - 1
    for name, values in generated.items():
        np.testing.assert_allclose(getattr(prompt, name)[rows], values, atol=1e-4)
    if mode == "processed":
        np.testing.assert_allclose(prompt.logz_k[rows], np.concatenate([a.logz_k for a in emitted])[:10], atol=1e-4)
    else:
        reference = hf_logprobs(target, sequence)[torch.arange(len(sequence) - 1), sequence[1:]]
        np.testing.assert_allclose(prompt.token_logprobs, reference, atol=1e-4)


# --- bad rows ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, field", [
    (dict(new_token_ids=[1, V + 3]), "rows[1].new_token_ids"),
    (dict(draft_token_ids=[V]), "rows[1].draft_token_ids"),
    (dict(new_token_ids=[]), "rows[1].new_token_ids"),
    (dict(new_token_ids=list(range(90)) * 2), "rows[1].new_token_ids"),
    (dict(emit=False, draft_token_ids=[1]), "rows[1].draft_token_ids"),
    (dict(logprobs=LogprobOptions(logprob_token_ids=[V + 1])), "rows[1].logprobs.logprob_token_ids"),
    (dict(draft_token_ids=[1], sampling=RowSampling(temperature=1.0, seed=3),
          proposal=Proposal(kind="dense", probs=np.full((1, V + 1), 1.0 / V, np.float32), draft_vocab_size=V + 1)),
     "rows[1].proposal.draft_vocab_size"),
    # a draft distribution that does not sum to 1 would bias the output silently
    (dict(draft_token_ids=[1], sampling=RowSampling(temperature=1.0, seed=3),
          proposal=Proposal(kind="sparse", ids=[[1, 2]], probs=[[0.5, 0.2]])), "rows[1].proposal.probs"),
])
def test_a_bad_row_gets_its_own_error_while_the_others_succeed(target, greedy_tokens, bad, field):
    verifier = new_verifier(target)
    bad_row = VerifyRow.model_validate({**vrow("bad", PROMPT).model_dump(), **bad})
    results = run(verifier, vrow("good", PROMPT, drafts=greedy_tokens[:2]), bad_row)
    good, _ = results["good"]
    assert good.error is None and good.token_ids.tolist() == greedy_tokens[:3]
    error = results["bad"][0].error
    assert error.code == ErrorCode.invalid_field and error.field == field and error.request_id == "bad"
    assert ("sched-test", "bad") not in verifier.requests and verifier.counters["rows_failed"] == 1


def test_sampling_values_the_kernels_refuse_fail_their_row_only(target, greedy_tokens):
    """Issue 11 item 2: SamplingInputError was no SpecbusError, so one row's value failed the
    whole batch as `internal`. The schema now refuses such values; a row that still carries one
    (built around the schema) fails alone, naming its field."""
    verifier = new_verifier(target)
    hot = RowSampling.model_construct(temperature=1e308, top_k=0, top_p=1.0, min_p=0.0, seed=3)  # inf in float32
    results = run(verifier, vrow("good", PROMPT, drafts=greedy_tokens[:2]),
                  vrow("hot", PROMPT).model_copy(update={"sampling": hot}))
    assert results["good"][0].error is None and results["good"][0].token_ids.tolist() == greedy_tokens[:3]
    error = results["hot"][0].error
    assert (error.code, error.field, error.request_id) == (ErrorCode.invalid_field, "rows[1].sampling.temperature", "hot")


def test_two_schedulers_may_use_the_same_request_id(target, greedy_tokens):
    """Issue 11 item 7: slots keyed by request_id alone let a second scheduler's request with the
    same id truncate the first one's slot."""
    verifier = new_verifier(target)

    def batch(scheduler_id, row, batch_id):
        request = VerifyRequest(batch_id=batch_id, scheduler_id=scheduler_id, deadline=time.time() + 30, rows=[row])
        return verify_batch(verifier, request)[0].rows[0]

    first = batch("sched-a", vrow("same", PROMPT), 1)
    batch("sched-b", vrow("same", PROMPT[:5]), 1)
    following = batch("sched-a", vrow("same", first.token_ids.tolist(), cached_len=len(PROMPT), step=1), 2)
    assert not following.need_resync and following.error is None
    assert [*first.token_ids.tolist(), *following.token_ids.tolist()] == greedy_tokens[:2]
    assert sorted(verifier.requests) == [("sched-a", "same"), ("sched-b", "same")]


# --- logit_bias and penalties --------------------------------------------------------------------

PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3, logit_bias={11: 2.0, 40: -3.0})


@pytest.fixture(scope="module")
def penalised_tokens(target):
    """The target's greedy continuation of PROMPT with PENALTIES, one token per step (k = 0)."""
    tokens, _, steps = generate(new_verifier(target), "plain", PROMPT, 16, **PENALTIES)
    assert steps == 16
    return tokens


def test_greedy_with_penalties_is_the_argmax_of_the_penalised_logits_at_any_k(target, greedy_tokens,
                                                                             penalised_tokens):
    assert penalised_tokens != greedy_tokens  # the penalties change the output
    with torch.no_grad():  # the first token: the argmax of the penalised logits, worked out here
        logits = target.hf(torch.tensor([PROMPT])).logits[0, -1]
    assert penalised_tokens[0] == int(penalised_reference(logits, PROMPT, []).argmax())

    def drafts_for(history, k):  # the penalised continuation with every third draft wrong
        position = len(history) - len(PROMPT)
        right = penalised_tokens[position:position + k]
        return [t if (position + i) % 3 else (t + 7) % V for i, t in enumerate(right)]

    tokens, _, steps = generate(new_verifier(target), "spec", PROMPT, 16, drafts_for, k=4, **PENALTIES)
    assert tokens == penalised_tokens
    assert steps < 16  # drafts were accepted, so later positions counted them


def test_a_migrated_request_rebuilds_its_counts_from_the_history(target, penalised_tokens):
    verifier = new_verifier(target)
    history = PROMPT + penalised_tokens[:6]
    for step in range(6):  # a fresh verifier re-prefills the history, then decodes
        cached_len = 0 if step == 0 else len(history) - 1
        result, _ = one(verifier, vrow("moved", history[cached_len:], cached_len, step=step, **PENALTIES))
        history += result.token_ids.tolist()
    assert history[len(PROMPT):] == penalised_tokens[:12]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=99)])
def test_logit_bias_of_minus_100_bans_a_token_and_plus_100_forces_it(target, greedy_tokens, sampling):
    banned = sorted(set(greedy_tokens))
    tokens, _, steps = generate(new_verifier(target), "ban", PROMPT, 20, lambda history, k: banned[:k], k=3,
                                logit_bias={t: -100.0 for t in banned}, **sampling)
    assert not set(tokens) & set(banned)
    assert steps == 20  # every draft (a banned token) was rejected
    tokens, _, steps = generate(new_verifier(target), "force", PROMPT, 20, lambda history, k: [7] * k, k=3,
                                logit_bias={7: 100.0}, **sampling)
    assert tokens == [7] * 20 and steps == 5  # and every draft of it accepted


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


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_processed_logprobs_are_those_of_the_penalised_distribution(target, mode):
    options = LogprobOptions(logprobs=3, logprob_token_ids=[11, 40], logprobs_mode=mode)
    # the biases make the (nearly uniform) tiny model favour three tokens, and the penalties
    # move the mass among them as they repeat, drafts included
    penalties = {**PENALTIES, "logit_bias": {11: 5.0, 40: 4.5, 3: 4.0}}
    favoured = [11, 40, 3]

    def drafts_for(history, k):
        return [favoured[(len(history) + i) % 3] for i in range(k)]

    tokens, records, steps = generate(new_verifier(target), "lp", PROMPT, 10, drafts_for, k=3, logprobs=options,
                                      temperature=0.9, seed=5, **penalties)
    assert steps < 9  # drafts were accepted: positions after them in a step counted them
    got = {name: np.concatenate([getattr(r.logprobs, name) for r in records])[:10]
           for name in ("token_logprobs", "top_ids", "top_logprobs", "requested_logprobs")}
    with torch.no_grad():
        logits = target.hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]  # (10, V)
    for i, token in enumerate(tokens):
        if mode == "raw":
            expected = logits[i].log_softmax(-1)  # the model's own, before any penalty
        else:  # no filter: K is the whole vocabulary and logz_k is 0
            expected = (penalised_reference(logits[i], PROMPT, tokens[:i], penalties) / 0.9).log_softmax(-1)
        np.testing.assert_allclose(got["token_logprobs"][i], expected[token], atol=1e-4)
        np.testing.assert_allclose(got["requested_logprobs"][i], expected[[11, 40]], atol=1e-4)
        top = expected.topk(3)
        np.testing.assert_allclose(got["top_logprobs"][i], top.values, atol=1e-4)
        assert got["top_ids"][i].tolist() == top.indices.tolist()


@pytest.mark.parametrize("sampling, field", [
    (RowSampling(temperature=0, logit_bias={V + 2: 1.0}), "rows[1].sampling.logit_bias"),  # outside the vocabulary
    # built around the schema, which refuses these
    (RowSampling.model_construct(temperature=0, repetition_penalty=0.0), "rows[1].sampling.repetition_penalty"),
    (RowSampling.model_construct(temperature=1.0, frequency_penalty=float("nan")),
     "rows[1].sampling.frequency_penalty"),
])
def test_a_penalty_the_kernels_refuse_fails_its_row_only(target, greedy_tokens, sampling, field):
    verifier = new_verifier(target)
    results = run(verifier, vrow("good", PROMPT, drafts=greedy_tokens[:2]),
                  vrow("bad", PROMPT).model_copy(update={"sampling": sampling}))
    assert results["good"][0].error is None and results["good"][0].token_ids.tolist() == greedy_tokens[:3]
    error = results["bad"][0].error
    assert (error.code, error.field, error.request_id) == (ErrorCode.invalid_field, field, "bad")
    assert ("sched-test", "bad") not in verifier.requests  # refused before it took a slot
