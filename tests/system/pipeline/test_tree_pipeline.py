"""Trees of drafts end to end: a stack (services.launch.stack.Stack, every service a process, a
real nats-server, the tiny target) whose scheduler asks for trees (`--max-tree-nodes 16`,
adaptive k off so every greedy and Gumbel-coupled decode step asks one) and whose drafter runs
`--draft-method ngram`, on prompts that repeat themselves, so prompt lookup finds several earlier
matches with different continuations and answers trees; then the same with the tiny draft model
(`--draft-method model`), which answers EAGLE-2 trees (gpu_worker/runtime/tree_draft.py) of its
best continuations. (The eagle drafter's trees: tests/system/pipeline/test_eagle_pipeline.py.) The
verifier takes them on its tree path:
greedy output must be the token ids of k=0, a seeded Gumbel-coupled request its k=0 stream, and
the usage must show steps that verified more nodes than a path can be deep."""

import asyncio

import pytest
import pytest_asyncio

from services.client import make_request

pytestmark = pytest.mark.asyncio(loop_scope="module")

K = 4
MAX_TREE_NODES = 16
MAX_TOKENS = 32
TIMEOUT_S = 120.0
# Each prompt names its pieces again and again with other continuations: "def " four times, " b"
# and "(a, b)" in every one, so the history's suffix has several earlier matches.
TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n    return a / b\n\ndef ",
    "for i in range(n):\n    total += i\nfor j in range(m):\n    count += j\n"
    "for k in range(n):\n    total -= k\nfor i in range(",
    "if x is None:\n    return None\nif y is None:\n    return x\nif x is y:\n    return y\nif ",
]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in TEXTS]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["ngram", "model"])
async def stack(request, start_stack, tiny_pair):
    # a generous draft timeout: a late answer would make a step run k=0 (the same output, but the
    # assertions on tree steps would then measure the machine's load)
    scheduler = ["--draft-timeout-s", "5", "--adaptive-k", "false", "--max-tree-nodes", str(MAX_TREE_NODES)]
    async with start_stack(*tiny_pair, draft_method=request.param, role_args={"scheduler": scheduler}) as running:
        yield running


def greedy(prompt, k):
    return make_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, num_speculative_tokens=k,
                        timeout_s=TIMEOUT_S)


def gumbel(prompt, seed, k):
    return make_request(prompt, max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True,
                        num_speculative_tokens=k, coupling="gumbel", timeout_s=TIMEOUT_S)


def tree_steps(usage) -> int:
    """Decode steps that verified more drafts than a path may be deep: trees that branched."""
    return sum(usage.speculative_lengths[K + 1:])


async def generate_all(client, requests):
    return await asyncio.gather(*(client.generate(request) for request in requests))


async def test_greedy_tree_steps_emit_the_k0_tokens(client, prompts):
    plain = await generate_all(client, [greedy(prompt, 0) for prompt in prompts])
    trees = await generate_all(client, [greedy(prompt, K) for prompt in prompts])
    for index, (a, b) in enumerate(zip(plain, trees)):
        assert b.token_ids == a.token_ids, f"prompt {index}"
        assert b.finish_reason == "length" and not b.degraded
        assert len(b.usage.speculative_lengths) <= MAX_TREE_NODES + 1
        assert b.usage.draft_tokens_proposed == sum(n * s for n, s in enumerate(b.usage.speculative_lengths))
    assert sum(tree_steps(r.usage) for r in trees) > 0, [r.usage.speculative_lengths for r in trees]
    assert sum(r.usage.draft_tokens_accepted for r in trees) > 0  # paths of the trees were accepted
    assert sum(r.usage.steps for r in trees) < sum(r.usage.steps for r in plain)


async def test_gumbel_coupled_tree_steps_emit_the_k0_stream(client, prompts):
    plain = await generate_all(client, [gumbel(prompt, 90 + i, 0) for i, prompt in enumerate(prompts)])
    trees = await generate_all(client, [gumbel(prompt, 90 + i, K) for i, prompt in enumerate(prompts)])
    assert [r.token_ids for r in trees] == [r.token_ids for r in plain]
    assert not any(r.degraded for r in trees)
    assert sum(tree_steps(r.usage) for r in trees) > 0, [r.usage.speculative_lengths for r in trees]
