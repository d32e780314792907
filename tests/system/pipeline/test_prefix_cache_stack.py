"""Prefix caching through a real multi-process stack (tiny random models, two client users).

alice sends a prompt, then a second turn: that prompt, its answer and a new message. Her second
turn is served from the verifier's prefix cache (the final chunk's usage.cached_tokens), and bob,
who sends the same second turn, shares nothing with her (per-user caches) and computes it
whole: the tokens are the same, seeded sampling with speculation on. Sent again, alice's second
turn hits all but its last token, with the same tokens once more.
"""

import pytest
import pytest_asyncio
import torch

from services.client import make_request
from tests.tiny_checkpoints import VT

pytestmark = pytest.mark.asyncio(loop_scope="module")


def sampled(prompt, max_tokens=12):
    return make_request(prompt, max_tokens=max_tokens, temperature=0.8, seed=7, ignore_eos=True,
                        num_speculative_tokens=3, timeout_s=120.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, tiny_random_pair):
    async with start_stack(*tiny_random_pair, client_users=("alice", "bob")) as running:
        yield running


async def test_a_second_turn_from_the_cache_is_the_turn_computed(stack):
    prompt = torch.randint(1, VT, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    async with stack.client("alice") as alice, stack.client("bob") as bob:
        first = await alice.generate(sampled(prompt))
        assert first.usage.cached_tokens == 0
        turn_2 = prompt + first.token_ids + [5, 6, 7, 8]
        hit = await alice.generate(sampled(turn_2))
        computed = await bob.generate(sampled(turn_2))
        again = await alice.generate(sampled(turn_2))
    assert hit.token_ids == computed.token_ids == again.token_ids
    assert hit.usage.cached_tokens == len(prompt) + len(first.token_ids) - 1  # its last token was never fed
    assert computed.usage.cached_tokens == 0
    assert again.usage.cached_tokens == len(turn_2) - 1
