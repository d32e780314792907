"""Adaptive speculation length through a real stack (services/scheduler/drafts/adaptive_k.py): the tiny
target with a useless draft (its embedding rows shuffled, ops/bench/drafts/bench_adaptive_k.py), so the
scheduler has every reason to change k. Greedy output must not change: each k=4 request gives the
token ids of k=0, whatever k its steps ran with, and usage says which ks those were."""

import pytest
import pytest_asyncio

from ops.bench.drafts.bench_adaptive_k import write_useless_draft
from services.client import make_request
from tests.system.pipeline.test_pipeline import held_out_prompts

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 40
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return held_out_prompts(tokenizer)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, tiny_pair, tmp_path_factory):
    useless_draft = write_useless_draft(tiny_pair[1], tmp_path_factory.mktemp("models") / "useless-draft")
    # generous draft timeout: a late drafter would flag steps draft_timeout, which is not the point here
    scheduler = ["--draft-timeout-s", "5", "--adaptive-k-probe-steps", "8",
                 "--suffix-max-tokens", "0"]  # no suffix index: the k asserted is the useless draft's
    async with start_stack(tiny_pair[0], useless_draft, role_args={"scheduler": scheduler}) as running:
        yield running


def greedy(prompt, k):
    return make_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, num_speculative_tokens=k,
                        timeout_s=TIMEOUT_S)


async def test_greedy_output_is_unchanged_while_the_scheduler_adapts_k(client, prompts):
    runs = []
    for prompt in prompts[:6]:  # one at a time: batch-1 steps, where the scheduler measures its costs
        plain = await client.generate(greedy(prompt, 0))
        adaptive = await client.generate(greedy(prompt, 4))
        assert adaptive.token_ids == plain.token_ids and len(plain.token_ids) == MAX_TOKENS
        assert plain.usage.speculative_lengths == [plain.usage.steps - 1]  # every decode step at k=0
        runs.append(adaptive.usage)
    for usage in runs:
        # every decode step is counted once, at the k it ran with (the prefill step is not one)
        assert sum(usage.speculative_lengths) == usage.steps - 1
        assert usage.draft_tokens_proposed == sum(k * n for k, n in enumerate(usage.speculative_lengths))
    lengths = [sum(u.speculative_lengths[k] if k < len(u.speculative_lengths) else 0 for u in runs) for k in range(5)]
    accepted = sum(u.draft_tokens_accepted for u in runs)
    assert accepted <= 0.1 * sum(u.draft_tokens_proposed for u in runs)  # the draft is useless indeed
    assert lengths[4] > 0 and lengths[0] > 0  # it measured k=4 and then stopped drafting
    # after the first requests (which measure each k) most steps ran without drafts, with probes
    late = runs[-3:]
    assert sum(u.speculative_lengths[0] for u in late) > 0.5 * sum(u.steps - 1 for u in late), lengths
    assert any(len(u.speculative_lengths) > 1 and u.speculative_lengths[1] for u in late), lengths  # probes
