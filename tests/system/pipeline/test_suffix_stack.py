"""Suffix decoding through a real stack (services/scheduler/drafts/suffix_index.py, suffix_choice.py: every
service a process, a real nats-server, the tiny pair). The scheduler drafts from its index of the
tenant's earlier requests; no output may change: greedy and seeded Gumbel-coupled requests give
the token ids of k=0, with the draft model's drafter killed mid-run too."""

import asyncio

import pytest
import pytest_asyncio

from services.client import make_request
from tests.system.api.test_gateway import scheduler_stats
from tests.system.pipeline.test_pipeline import held_out_prompts

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 32
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return held_out_prompts(tokenizer)[:4]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, tiny_pair):
    # adaptive k off: a "suffix" row takes the index's whole proposal every step, so whether its
    # drafts are used does not depend on the machine's timings; a generous draft timeout
    scheduler = ["--draft-timeout-s", "5", "--adaptive-k", "false"]
    async with start_stack(*tiny_pair, role_args={"scheduler": scheduler}) as running:
        yield running


def request(prompt, k, method="auto", **sampling):
    sampling = {"temperature": 0.0} | sampling
    return make_request(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, num_speculative_tokens=k,
                        draft_method=method, timeout_s=TIMEOUT_S, **sampling)


async def generate_all(client, requests):
    return await asyncio.gather(*(client.generate(r) for r in requests))


async def test_suffix_drafts_change_no_greedy_or_gumbel_output(stack, prompts):
    gumbel = {"temperature": 1.0, "top_p": 0.95, "coupling": "gumbel"}
    async with stack.client() as client:
        plain = await generate_all(client, [request(p, 0) for p in prompts])
        sampled = await generate_all(client, [request(p, 0, seed=7 + i, **gumbel) for i, p in enumerate(prompts)])
        before = await scheduler_stats(stack)
        # the same prompts again: the index holds what followed them, so the suffix drafts
        suffix = await generate_all(client, [request(p, 4, "suffix") for p in prompts])
        suffix_sampled = await generate_all(client, [request(p, 4, "suffix", seed=7 + i, **gumbel)
                                                     for i, p in enumerate(prompts)])
        auto = await generate_all(client, [request(p, 4) for p in prompts])
        after = await scheduler_stats(stack)
    assert [r.token_ids for r in suffix] == [r.token_ids for r in plain] == [r.token_ids for r in auto]
    assert [r.token_ids for r in suffix_sampled] == [r.token_ids for r in sampled]
    assert len({tuple(r.token_ids) for r in sampled}) > 1 and sampled[0].token_ids != plain[0].token_ids
    # the greedy outputs were seen whole: most drafts accepted (a first draft may follow the sampled run of the
    # same prompt, the more recent), many tokens a step
    accepted = sum(r.usage.draft_tokens_accepted for r in suffix)
    assert accepted > 0.6 * sum(r.usage.draft_tokens_proposed for r in suffix) and accepted > 2 * MAX_TOKENS
    assert sum(r.usage.steps for r in suffix) < sum(r.usage.steps for r in plain) / 2
    assert not any(r.degraded for r in suffix + suffix_sampled)  # no drafter, and none missed
    assert after.get("suffix_rows", 0) - before.get("suffix_rows", 0) >= sum(r.usage.steps - 1 for r in suffix)


async def test_killing_the_drafter_mid_run_changes_no_output(stack, prompts):
    async with stack.client() as client:
        plain = await generate_all(client, [request(p, 0) for p in reversed(prompts)])
        streams = [asyncio.create_task(client.generate(request(p, 4))) for p in reversed(prompts)]
        while not (await scheduler_stats(stack)).get("running"):
            await asyncio.sleep(0.05)
        [drafter] = [i for i, beat in stack.heartbeats.items() if beat.role == "drafter"]
        stack.kill(drafter)
        results = await asyncio.gather(*streams)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
