"""Prompt lookup end to end: a stack whose drafter runs `--draft-method ngram` (no draft model,
services.launch.stack.Stack, every service a process, a real nats-server, the tiny target).
Speculation with n-gram drafts must change no output: greedy k=4 equals k=0 token for token,
and so does a seeded Gumbel-coupled sampled request."""

import asyncio

import pytest
import pytest_asyncio

from ops.train.train_models import read_text, source_files
from schemas.bus.protocol import ANY_TOKENIZER
from services.client import make_request

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 32
PROMPT_TOKENS = 48
NUM_PROMPTS = 6
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """PROMPT_TOKENS tokens from the start of each of the first held-out stdlib files: source
    text repeats itself (names, keywords), so the history has n-grams to find."""
    _, held_out = source_files()
    found = [ids[:PROMPT_TOKENS] for ids in (tokenizer.encode(read_text(path)) for path in held_out[:3 * NUM_PROMPTS])
             if len(ids) >= PROMPT_TOKENS]
    assert len(found) >= NUM_PROMPTS
    return found[:NUM_PROMPTS]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, tiny_pair):
    # adaptive k off: every step drafts the k it names (adaptive k picks k from wall-clock costs,
    # so with it on, whether any draft is accepted in 32 tokens would depend on the machine's
    # speed). A generous draft timeout: a late answer would make a step run k=0 (still the same
    # output, but the assertions on accepted drafts would then measure the machine's load)
    scheduler = ["--draft-timeout-s", "5", "--adaptive-k", "false"]
    async with start_stack(tiny_pair[0], draft_method="ngram", role_args={"scheduler": scheduler}) as running:
        yield running


def greedy(prompt, k, max_tokens=MAX_TOKENS, **options):
    return make_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=k,
                        timeout_s=TIMEOUT_S, **options)


def gumbel(prompt, seed, k):
    return make_request(prompt, max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True,
                        num_speculative_tokens=k, coupling="gumbel", timeout_s=TIMEOUT_S)


async def generate_all(client, requests):
    return await asyncio.gather(*(client.generate(request) for request in requests))


async def test_the_ngram_drafter_needs_no_model_and_fits_the_target(stack):
    [drafter] = [beat for beat in stack.heartbeats.values() if beat.role == "drafter"]
    assert drafter.model_ids["draft_method"] == "ngram" and drafter.model_ids["tokenizer"] == ANY_TOKENIZER


@pytest.mark.parametrize("method", ["ngram", "auto"])
async def test_greedy_with_ngram_drafts_equals_plain_greedy(client, prompts, method):
    plain = await generate_all(client, [greedy(prompt, 0) for prompt in prompts])
    speculative = await generate_all(client, [greedy(prompt, 4, draft_method=method) for prompt in prompts])
    for index, (a, b) in enumerate(zip(plain, speculative)):
        assert b.token_ids == a.token_ids, f"prompt {index}"
        assert b.finish_reason == "length" and not b.degraded
    assert sum(r.usage.draft_tokens_proposed for r in speculative) > 0
    assert sum(r.usage.draft_tokens_accepted for r in speculative) > 0  # drafts were really verified
    assert sum(r.usage.steps for r in speculative) < sum(r.usage.steps for r in plain)


async def test_a_request_for_model_drafts_runs_k0_flagged_with_the_same_output(client, prompts):
    plain, model = await generate_all(client, [greedy(prompts[0], 0), greedy(prompts[0], 4, draft_method="model")])
    assert model.token_ids == plain.token_ids and model.usage.draft_tokens_proposed == 0
    assert model.degraded == ["draft_timeout"]


async def test_gumbel_coupled_sampling_with_ngram_drafts_equals_k0(client, prompts):
    plain = await generate_all(client, [gumbel(prompt, 70 + i, 0) for i, prompt in enumerate(prompts)])
    speculative = await generate_all(client, [gumbel(prompt, 70 + i, 4) for i, prompt in enumerate(prompts)])
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert sum(r.usage.draft_tokens_proposed for r in speculative) > 0
