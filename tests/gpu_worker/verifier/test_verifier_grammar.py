"""Structured outputs in the verifier (gpu_worker/verifier/verifier_grammar.py): every emitted token
follows the grammar, speculation (drafts the grammar refuses, forced tokens) changes no bit of
greedy output in fp32 and bf16, sampled rows keep the masked law, and a bad grammar fails its
row alone, naming the field."""

import json
import time

import numpy as np
import pytest
import torch

from gpu_worker.batching.grammar_masks import warm_grammars
from gpu_worker.verifier.verifier_core import load_verifier, verify_batch
from schemas.config import VerifierConfig, load_config
from schemas.generation import LogprobOptions, RowSampling
from schemas.steps import Proposal, VerifyRequest, VerifyRow
from text.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"enum": ["small", "large"]}},
          "required": ["name", "size"], "additionalProperties": False}
KINDS = {"json": {"json": SCHEMA}, "regex": {"regex": "[0-9]{2,4}-(ab|cd)"},
         "choice": {"choice": ["yes", "no", "maybe"]}, "grammar": {"grammar": 'start: "x" ("+" "x")* "."'}}


@pytest.fixture(scope="module")
def target(tiny_random_pair):
    return tiny_random_pair[0]


def verifier_of(target, dtype="float32"):
    return load_verifier(load_config(VerifierConfig, env={}, target_model=str(target), instance_id="v", max_slots=16,
                                     max_seq_len=512, dtype=dtype))


def step(verifier, request_id, history, cached_len, prompt_len, drafts=(), max_forced=0, step=0, **sampling):
    row = VerifyRow(request_id=request_id, row=0, step=step, cached_len=cached_len,
                    new_token_ids=history[cached_len:], draft_token_ids=list(drafts),
                    sampling=RowSampling(**{"temperature": 0, **sampling}), logprobs=LogprobOptions(),
                    prompt_len=prompt_len, max_forced=max_forced)
    response, _ = verify_batch(verifier, VerifyRequest(batch_id=step + 1, scheduler_id="s", deadline=time.time() + 60,
                                                       rows=[row]))
    return response.rows[0]


def decode(verifier, request_id, prompt, spec, eos, max_tokens=40, k=0, drafts_for=None, **sampling):
    """A scheduler's loop with a grammar: (output tokens, steps, forced tokens accepted)."""
    history, cached_len, steps, forced = list(prompt), 0, 0, 0
    while len(history) - len(prompt) < max_tokens and history[-1] != eos:
        drafts = drafts_for(history, k) if drafts_for else []
        left = max_tokens - (len(history) - len(prompt)) - 1
        result = step(verifier, request_id, history, cached_len, len(prompt), drafts,
                      max_forced=max(0, min(k, left) - len(drafts)) if k else 0, step=steps,
                      structured_outputs=spec, **sampling)
        assert result.error is None, result.error
        cached_len = len(history) + result.num_accepted
        emitted = result.token_ids.tolist()
        emitted = emitted[:emitted.index(eos) + 1] if eos in emitted else emitted  # the scheduler cuts at EOS
        history += emitted[:max_tokens - (len(history) - len(prompt))]
        forced += max(0, result.num_accepted - (result.num_draft - result.num_replaced))
        steps += 1
    return history[len(prompt):], steps, forced


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_with_a_grammar_is_the_same_with_drafts_and_forced_tokens(target, kind, dtype):
    tokenizer = load_tokenizer(target)
    eos = tokenizer.eos_ids[0]
    prompt = tokenizer.encode("Answer: ")
    verifier = verifier_of(target, dtype)
    plain, plain_steps, _ = decode(verifier, "plain", prompt, KINDS[kind], eos)
    text = tokenizer.decode(plain)
    if kind == "json":
        assert set(json.loads(text)) == {"name", "size"}, text
    if kind == "choice":
        assert text in KINDS["choice"]["choice"]
    assert plain[-1] == eos, "the grammar finished within max_tokens and EOS ended it"

    # drafts: the plain output with every third token wrong (often a token the grammar refuses)
    def drafts_for(history, k):
        done = len(history) - len(prompt)
        return [(t + 7) % 4000 if (done + i) % 3 == 2 else t for i, t in enumerate(plain[done:done + k])]

    spec_out, spec_steps, forced = decode(verifier, "spec", prompt, KINDS[kind], eos, k=4, drafts_for=drafts_for)
    assert spec_out == plain
    assert spec_steps < plain_steps
    alone, _, forced_alone = decode(verifier, "forced", prompt, KINDS[kind], eos, k=4)  # forced tokens, no drafter
    assert alone == plain
    if kind in ("json", "choice"):
        assert forced_alone > 0


def test_sampled_rows_draw_only_what_the_grammar_allows(target):
    tokenizer = load_tokenizer(target)
    eos = tokenizer.eos_ids[0]
    verifier = verifier_of(target)
    spec = {"regex": "[a-c]{3}[0-9]"}
    for seed in range(6):
        out, _, _ = decode(verifier, f"s{seed}", tokenizer.encode("x"), spec, eos, k=4, temperature=1.0, seed=seed)
        text = tokenizer.decode(out)
        assert len(text) == 4 and set(text[:3]) <= set("abc") and text[3].isdigit(), text
        again, _, _ = decode(verifier, f"t{seed}", tokenizer.encode("x"), spec, eos, temperature=1.0, seed=seed)
        assert again == out, "forced tokens change no sampled draw (same seed, same positions)"


def test_a_grammar_that_does_not_compile_fails_its_row_naming_the_field(target):
    verifier = verifier_of(target)
    result = step(verifier, "bad", [5, 6, 7], 0, 3, structured_outputs={"grammar": "start: undefined_rule"})
    assert result.error is not None and result.error.field == "rows[0].sampling.structured_outputs"
    good = step(verifier, "good", [5, 6, 7], 0, 3, structured_outputs={"choice": ["a"]})
    assert good.error is None and len(good.token_ids) == 1


WIDE = "start: " + " | ".join('"w%dz"' % i for i in range(3000))  # an Earley row past its limit
RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}  # an object that never ends: the forced-token search runs past its limit


@pytest.mark.parametrize("spec", [{"grammar": WIDE}, {"json": RECURSIVE}], ids=["wide", "recursive"])
def test_a_grammar_that_breaks_the_matcher_fails_its_row_not_the_batch(target, spec):
    """A grammar that compiles but whose matcher fails on a token (work past LIMITS) fails its
    own row with invalid_field naming the field; the other row of the same batch is answered."""
    verifier = verifier_of(target)
    rows = [VerifyRow(request_id=request_id, row=index, step=0, cached_len=0, new_token_ids=[5, 6, 7],
                      sampling=RowSampling(temperature=0, structured_outputs=sampling), logprobs=LogprobOptions(),
                      prompt_len=3, max_forced=4)
            for index, (request_id, sampling) in enumerate((("bad", spec), ("good", {"choice": ["a"]})))]
    response, _ = verify_batch(verifier, VerifyRequest(batch_id=1, scheduler_id="s", deadline=time.time() + 60,
                                                       rows=rows))
    bad, good = response.rows
    assert bad.error is not None and bad.error.code.value == "invalid_field", bad
    assert bad.error.field == "rows[0].sampling.structured_outputs" and "grammar fails" in bad.error.message
    assert good.error is None and len(good.token_ids) >= 1


def test_masked_logits_keep_raw_and_processed_apart(target):
    """The mask is -inf outside the grammar's tokens and leaves the allowed logits' bits alone."""
    from gpu_worker.batching.grammar_masks import mask_logits
    logits = torch.randn(2, 10)
    allowed = torch.zeros(2, 10, dtype=torch.bool)
    allowed[0, 3] = allowed[1, [1, 4]] = True
    out = mask_logits(logits, allowed)
    assert torch.equal(out[allowed], logits[allowed]) and bool((out[~allowed] == float("-inf")).all())


def test_refused_drafts_give_way_to_forced_tokens_only_where_the_proposal_allows(target):
    """A greedy row's draft the grammar refuses is replaced by the forced token (accepted: it is
    the only one allowed), and a Gumbel-coupled row's likewise (its draft law plays no part); a
    rejection-sampled row's drafted law must stay whole, so it keeps its drafts."""
    tokenizer = load_tokenizer(target)
    verifier = verifier_of(target)
    spec = {"choice": ["abcdef"]}
    refused = tokenizer.encode("zzz")[0]
    greedy = step(verifier, "g", [5, 6, 7], 0, 3, drafts=[refused], structured_outputs=spec)
    assert (greedy.num_draft, greedy.num_replaced, greedy.num_forced, greedy.num_accepted) == (1, 1, 1, 1)
    assert tokenizer.decode(greedy.token_ids.tolist()).startswith("ab")
    proposal = Proposal(kind="sparse", ids=np.array([[refused]], dtype=np.int32), probs=np.array([[1.0]], np.float32))
    for coupling, expected in (("gumbel", (1, 2, 2)), ("rejection", (0, 0, 0))):
        row = VerifyRow(request_id=coupling, row=0, step=0, cached_len=0, new_token_ids=[5, 6, 7],
                        draft_token_ids=[refused], proposal=proposal, prompt_len=3, max_forced=2,
                        sampling=RowSampling(temperature=1.0, seed=3, structured_outputs=spec, coupling=coupling))
        sampled = verify_batch(verifier, VerifyRequest(batch_id=9, scheduler_id="s", deadline=time.time() + 60,
                                                       rows=[row]))[0].rows[0]
        assert (sampled.num_replaced, sampled.num_forced, sampled.num_accepted) == expected, coupling
        assert tokenizer.decode(sampled.token_ids.tolist()).startswith("ab" if coupling == "gumbel" else "a")


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_report_the_raw_law_or_the_masked_one(target, mode):
    """raw: the model's log_softmax, the same bits as without a grammar; processed: the masked
    law the token was drawn from, nothing outside the grammar's tokens."""
    verifier = verifier_of(target)
    spec = {"regex": "[0-9]+"}

    def record(request_id, **sampling):
        row = VerifyRow(request_id=request_id, row=0, step=0, cached_len=0, new_token_ids=[5, 6, 7],
                        sampling=RowSampling(temperature=1.0, seed=9, **sampling), prompt_len=3,
                        logprobs=LogprobOptions(logprobs=8, logprobs_mode=mode), postprocessor_id="post")
        _, records = verify_batch(verifier, VerifyRequest(batch_id=1, scheduler_id="s", deadline=time.time() + 60,
                                                          rows=[row]))
        return records[0][1].logprobs

    free, masked = record("free"), record("masked", structured_outputs=spec)
    tokenizer = load_tokenizer(target)
    digits = {i for i in range(verifier.vocab_size) if tokenizer.decode([i]).isdigit()}
    if mode == "raw":
        assert np.array_equal(free.top_ids, masked.top_ids) and np.array_equal(free.top_logprobs, masked.top_logprobs)
    else:
        finite = np.isfinite(masked.top_logprobs[0])
        assert set(masked.top_ids[0][finite].tolist()) <= digits and finite.any()
        assert not set(free.top_ids[0].tolist()) <= digits


def test_warm_grammars_compiles_before_the_first_row(target):
    """The verifier and the drafter warm their grammars before they heartbeat: the first row
    with a grammar pays no tokenizer view and no first compile."""
    verifier = verifier_of(target)
    assert verifier.grammars is None
    warm_grammars(verifier, verifier.vocab_size)
    assert verifier.grammars is not None and len(verifier.grammars.templates) == 1
