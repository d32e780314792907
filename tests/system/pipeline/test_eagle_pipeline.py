"""EAGLE drafts end to end: a stack whose drafter runs `--draft-method eagle` (services.launch.stack.Stack,
every service a process, a real nats-server, the tiny target), once in float32 and once in
bfloat16. The head is fitted in the fixture (a few dozen steps of ops/train/train_eagle.py's losses on
one prefill's features) to a periodic text whose continuation the target repeats, so drafts for
it are accepted: the test sees the features travel verifier -> scheduler -> drafter and drafts
come back verified. Speculation must change no output: greedy k=4 equals k=0 token for token with
the same logprobs, a seeded Gumbel-coupled sample is the same at k=0 and k=4, and so is a stream
whose drafter is killed (SIGKILL) and restarted mid-way, which then drafts again. The bfloat16 stack
asks trees (`--max-tree-nodes 12`: the head answers EAGLE-2 trees, gpu_worker/runtime/eagle.py
`draft_tree`), so all of that holds with trees too, and steps verify more nodes than a path is deep."""

import asyncio
import signal
import time

import pytest
import pytest_asyncio
import torch

from gpu_worker.runtime.checkpoint import load_d2t, load_model
from gpu_worker.runtime.eagle import EagleConfig
from ops.train.eagle_training import init_weights, save_head
from gpu_worker.runtime.kv_cache import KVCache
from ops.train.train_models import read_text, source_files
from tests.ops_scripts import load_train_eagle
from tests.system.pipeline.test_ngram_pipeline import generate_all, greedy, gumbel  # requests as the ngram stack's

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT_TOKENS = 32
PERIOD = "def f(a, b):\n    return a + b\n\n"  # the tiny target continues it by repeating it
FIT_STEPS = 40
MAX_TREE_NODES = 12
KILL_MAX_TOKENS = 1500  # the stream whose drafter is killed: cancelled once drafts are accepted again


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """PROMPT_TOKENS tokens from the start of each of the first held-out stdlib files, then the
    periodic text three times (the one whose drafts the head was fitted to)."""
    _, held_out = source_files()
    found = [ids[:PROMPT_TOKENS] for ids in (tokenizer.encode(read_text(path)) for path in held_out[:9])
             if len(ids) >= PROMPT_TOKENS]
    return found[:3] + [tokenizer.encode(PERIOD * 3)]


@pytest.fixture(scope="module")
def head(tiny_pair, tokenizer, tmp_path_factory):
    """An EAGLE head for the tiny target fitted (FIT_STEPS Adam steps of train_eagle's chain
    losses, two chain steps) to the target's features of the periodic text repeated."""
    target, draft = tiny_pair
    ops = load_train_eagle()
    model, tconfig = load_model(target, max_seq_len=512)
    ids = tokenizer.encode(PERIOD * 12)
    features = ops.conversation_features(model, tconfig, KVCache(tconfig, max_slots=1, max_seq_len=512), ids, "cpu")
    config = EagleConfig.from_target(tconfig)
    maps = load_d2t(draft)
    embed = model.embed.float()
    weights = {n: t.requires_grad_(True) for n, t in init_weights(config, ops.target_weights(target), seed=0).items()}
    optimizer = torch.optim.Adam(list(weights.values()), lr=3e-3)
    batch = ops.batch_tensors([{"id": "0", "start": 0, "ids": torch.tensor(ids), "features": features}], "cpu")
    for _ in range(FIT_STEPS):
        parts = ops.chain_losses(weights, config, embed, embed[maps.d2t], maps.other_id, *batch, steps=2)
        loss = sum(reg + ce for reg, ce, _, _ in parts)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path = tmp_path_factory.mktemp("eagle")
    save_head(path, config, {n: t.detach() for n, t in weights.items()}, maps)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["float32", "bfloat16"])
async def stack(request, start_stack, tiny_pair, head):
    # adaptive k off: every step drafts the k it names (and in bf16 asks a tree of MAX_TREE_NODES).
    # A generous draft timeout: a late answer would run the step k=0 (the same output, but the
    # acceptance asserted would measure the load)
    scheduler = ["--draft-timeout-s", "5", "--adaptive-k", "false"]
    trees = request.param == "bfloat16"
    if trees:
        scheduler += ["--max-tree-nodes", str(MAX_TREE_NODES)]
    async with start_stack(tiny_pair[0], draft_method="eagle", eagle_head=str(head), dtype=request.param,
                           role_args={"scheduler": scheduler}) as running:
        running.asks_trees = trees
        yield running


def tree_steps(usage) -> int:
    """Decode steps that verified more drafts than a path may be deep (k = 4): trees that branched."""
    return sum(usage.speculative_lengths[5:])


async def test_the_eagle_drafter_serves_the_stacks_target(stack):
    [drafter] = [beat for beat in stack.heartbeats.values() if beat.role == "drafter"]
    [verifier] = [beat for beat in stack.heartbeats.values() if beat.role == "verifier"]
    assert drafter.model_ids["draft_method"] == "eagle" and drafter.model_ids["target"] == verifier.model_ids["target"]
    assert drafter.model_ids["hidden_size"] == verifier.model_ids["hidden_size"] == "192"


async def test_greedy_with_eagle_drafts_equals_plain_greedy_with_the_same_logprobs(stack, client, prompts):
    plain = await generate_all(client, [greedy(prompt, 0, logprobs=2) for prompt in prompts])
    speculative = await generate_all(client, [greedy(prompt, 4, logprobs=2) for prompt in prompts])
    for index, (a, b) in enumerate(zip(plain, speculative)):
        assert b.token_ids == a.token_ids, f"prompt {index}"
        assert [(e.logprob, e.top_ids.tolist(), e.top_logprobs.tolist()) for e in b.logprobs] == \
            [(e.logprob, e.top_ids.tolist(), e.top_logprobs.tolist()) for e in a.logprobs], f"prompt {index}"
        assert b.finish_reason == "length" and not b.degraded
    assert sum(r.usage.draft_tokens_proposed for r in speculative) > 0
    assert sum(r.usage.draft_tokens_accepted for r in speculative) > 0  # the head's drafts were verified
    assert sum(r.usage.steps for r in speculative) < sum(r.usage.steps for r in plain)
    assert (sum(tree_steps(r.usage) for r in speculative) > 0) == stack.asks_trees, \
        [r.usage.speculative_lengths for r in speculative]


async def test_gumbel_coupled_sampling_with_eagle_drafts_equals_k0(stack, client, prompts):
    plain = await generate_all(client, [gumbel(prompt, 70 + i, 0) for i, prompt in enumerate(prompts)])
    speculative = await generate_all(client, [gumbel(prompt, 70 + i, 4) for i, prompt in enumerate(prompts)])
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert sum(r.usage.draft_tokens_proposed for r in speculative) > 0
    assert (sum(tree_steps(r.usage) for r in speculative) > 0) == stack.asks_trees


async def test_a_drafter_killed_mid_stream_changes_nothing_and_speculation_comes_back(stack, client, prompts):
    [drafter_id] = [i for i, beat in stack.heartbeats.items() if beat.role == "drafter"]
    tokens, degraded, restarted_at, accepted_after = [], set(), None, 0
    async with await client.open_stream(greedy(prompts[-1], 4, KILL_MAX_TOKENS)) as stream:
        async for chunk in stream:
            tokens += chunk.token_ids.tolist()
            degraded |= set(chunk.degraded)
            if restarted_at is not None:
                accepted_after += sum(chunk.from_draft)
            if len(tokens) >= 8 and restarted_at is None:
                stack.kill(drafter_id, signal.SIGKILL)
                await stack.wait_exit(drafter_id)
                await asyncio.sleep(0.5)  # steps run without a drafter meanwhile
                await stack.start_instance("drafter", drafter_id)
                restarted_at = time.monotonic()
            if accepted_after >= 8:
                break  # closing the stream cancels the rest
    assert accepted_after >= 8, "no draft accepted after the drafter came back"
    assert degraded & {"draft_timeout", "resync"}  # steps without drafts while it was away
    reference = await client.generate(greedy(prompts[-1], 0, len(tokens)))
    assert tokens == reference.token_ids
