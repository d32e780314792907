"""Chain against tree drafts with the shipped EAGLE head, greedy, batch 1: tokens per target
step by tree size, what a tree verify forward costs by node count, and the speed they predict.

Tokens per step. Greedy verification of a tree accepts the longest path from the root whose
tokens are the target's greedy continuation (gpu_worker/sampling/tree_acceptance.py), and every
node's logits are a decode step's bit for bit (gpu_worker/runtime/tree_forward.py). So the
accepted path is found here against the target's k=0 output, computed once per prompt, without
a tree forward per step. Trees are EAGLE-2's (Li et al. 2024, "EAGLE-2", sec. 4): from the root,
each depth expands the `topk` best nodes of the previous depth (by cumulative draft log
probability) into their `topk` best tokens, and the `nodes` best of all are kept (a node's
ancestors score at least as high, so kept nodes form a tree). A chain is topk 1. The head drafts
each node after its own path (its cache rolled back and the path fed again): the same logits a
drafter with tree attention in the head would compute, at more head time, which is not
measured here.

Cost. A chain's verify (`forward` of k + 1 tokens) and a tree's (`tree_forward` of a bushy tree
of as many nodes: the root's topk children, theirs, ...) after a 128-token context, against
`forward` of one token: the verify's share of a step.

Predicted speed against k=0: tokens per step / verify cost, the draft's time left out (a head
step per drafted depth; its cost against a target step: ops/bench/RESULTS.md, "What a head step
costs"). Beside each tree's
cost, a chain of as many positions: what the tree's attention adds.

Prompt lookup (`--drafter ngram`): the input-grounded held-out turns of ops/bench/drafts/bench_ngram.py,
a chain from the most recent match (`propose_ngram`, k = depth) against trees merged from every
match (`propose_ngram_tree`, ngram_max 4, min 1), the same replay.

    PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_tree.py --prompts 8 --max-new 96
    PYTHONPATH=. .venv/bin/python ops/bench/drafts/bench_tree.py --drafter ngram --prompts 8 --max-new 128
"""

import argparse
import statistics
import time

import numpy as np
import torch

from gpu_worker.drafter.ngram import propose_ngram, propose_ngram_tree
from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.eagle import head_forward, load_head, new_cache
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from gpu_worker.runtime.tree_forward import ROOT, tree_forward
from ops.bench.kernels.bench_forward import FORMATS
from ops.bench.drafts.bench_ngram import input_grounded_prompts
from ops.train.train_eagle import sharegpt_prompts, speculative_greedy
from schemas.config import DEFAULT_EAGLE_HEAD, default_target_model
from text.chat_template import render_chat
from text.tokenizer import load_tokenizer

# (topk, depth, nodes): a chain of 4, then trees of 8 to 64 nodes
TREES = [(1, 4, 4), (2, 4, 8), (3, 4, 12), (4, 5, 16), (4, 6, 24), (6, 6, 32), (8, 8, 64)]
# prompt lookup: (topk for the verify's cost, depth, nodes): chains of 4 and 8, then trees
NGRAM_TREES = [(1, 4, 4), (1, 8, 8), (2, 8, 16), (4, 8, 32), (8, 8, 64)]
NGRAM_MAX = 4


def greedy_continuation(model, config, prompt: list[int], max_new: int,
                        eos: tuple[int, ...]) -> tuple[list, torch.Tensor]:
    """The target's k=0 output after prompt (ops/train/train_eagle.py `speculative_greedy` at k=0) and
    the features (final-normed hidden states, bf16 as the serving path ships them) of every
    position of prompt + output, (P + n, E)."""
    out, _ = speculative_greedy(model, config, None, prompt, max_new, 0, eos)
    sequence = prompt + out
    cache = KVCache(config, max_slots=1, max_seq_len=len(sequence), dtype=model.embed.dtype)
    slot = torch.tensor([cache.allocate()])
    _, hidden = forward(model, cache, slot, torch.tensor([sequence]), torch.tensor([len(sequence)]), return_hidden=True)
    return out, hidden[0].to(torch.bfloat16)


def draft_tree(head, cache: KVCache, slot: torch.Tensor, root_logits: torch.Tensor, root_feature: torch.Tensor,
               topk: int, depth: int, nodes: int) -> list[tuple[int, int]]:
    """EAGLE-2's tree (module docstring) as (parent, target token) per kept node, parents first;
    parent ROOT for the root's children. root_logits (Vd,) and root_feature (E,): the head's output
    at the slot's last pair; the slot is left as it was."""
    committed = int(cache.lengths[int(slot)])
    drafted = []  # (score, depth, parent, token, feature or None)

    def expand(parent: int, logits: torch.Tensor, score: float, level: int) -> list[int]:
        logprobs, ids = torch.log_softmax(logits.float(), -1).topk(topk)
        start = len(drafted)
        drafted.extend([score + float(lp), level, parent, int(head.d2t[i]), None]
                       for lp, i in zip(logprobs.tolist(), ids.tolist()))
        return list(range(start, len(drafted)))

    frontier = expand(ROOT, root_logits, 0.0, 1)
    for level in range(2, depth + 1):
        children = []
        for node in sorted(frontier, key=lambda n: -drafted[n][0])[:topk]:
            path = [node]
            while drafted[path[-1]][2] != ROOT:
                path.append(drafted[path[-1]][2])
            path.reverse()
            features = torch.stack([root_feature] + [drafted[n][4] for n in path[:-1]])[None]
            tokens = torch.tensor([[drafted[n][3] for n in path]])
            logits, predicted = head_forward(head, cache, slot, features, tokens, torch.tensor([len(path)]),
                                             logits_index=torch.tensor([[len(path) - 1]]))
            cache.truncate(int(slot), committed)
            drafted[node][4] = predicted[0, 0]
            children += expand(node, logits[0, 0], drafted[node][0], level)
        frontier = children
    kept = sorted(sorted(range(len(drafted)), key=lambda n: (-drafted[n][0], drafted[n][1]))[:nodes])
    index = {n: i for i, n in enumerate(kept)}
    return [(index.get(drafted[n][2], ROOT), drafted[n][3]) for n in kept]


def accepted_length(tree: list[tuple[int, int]], truth: list[int]) -> int:
    """The longest path from the root whose tokens are truth's first ones."""
    at, length = ROOT, 0
    while length < len(truth):
        child = next((i for i, (parent, token) in enumerate(tree) if parent == at and token == truth[length]), None)
        if child is None:
            return length
        at, length = child, length + 1
    return length


def tokens_per_step(head, out: list[int], prompt: list[int], features: torch.Tensor, trees: list) -> dict:
    """{tree: (tokens, target steps)} over one prompt's k=0 output."""
    sequence, P = prompt + out, len(prompt)
    counts = {}
    for topk, depth, nodes in trees:
        cache = new_cache(head, 1, len(sequence) + depth + 1)
        slot = torch.tensor([cache.allocate()])
        # pairs (feature t, token t + 1) up to the root, the last committed token (sequence[P])
        logits, predicted = head_forward(head, cache, slot, features[None, :P], torch.tensor([sequence[1:P + 1]]),
                                         torch.tensor([P]), logits_index=torch.tensor([[P - 1]]))
        at, tokens, steps = P, 0, 0
        while at < len(sequence) - 1:
            tree = draft_tree(head, cache, slot, logits[0, 0], predicted[0, 0], topk, depth, nodes)
            emitted = min(accepted_length(tree, sequence[at + 1:]) + 1, len(sequence) - 1 - at)
            tokens, steps = tokens + emitted, steps + 1
            logits, predicted = head_forward(head, cache, slot, features[None, at:at + emitted],
                                             torch.tensor([sequence[at + 1:at + emitted + 1]]),
                                             torch.tensor([emitted]), logits_index=torch.tensor([[emitted - 1]]))
            at += emitted
        counts[(topk, depth, nodes)] = (tokens, steps)
    return counts


def ngram_tokens_per_step(out: list[int], prompt: list[int], trees: list) -> dict:
    """{tree: (tokens, target steps)} of prompt lookup over one prompt's k=0 output: a chain
    (topk 1) from the most recent match, else a tree from every match."""
    counts = {}
    for topk, depth, nodes in trees:
        at, tokens, steps = 0, 1, 1  # the prefill step emits out[0]
        while at < len(out) - 1:
            history = np.array(prompt + out[:at + 1])
            if topk == 1:
                drafts = propose_ngram(history, depth, NGRAM_MAX)
                tree = [(i - 1, token) for i, token in enumerate(drafts)]
            else:
                tree = list(zip(*propose_ngram_tree(history, nodes, depth, NGRAM_MAX)[::-1]))
            emitted = min(accepted_length(tree, out[at + 1:]) + 1, len(out) - 1 - at)
            tokens, steps, at = tokens + emitted, steps + 1, at + emitted
        counts[(topk, depth, nodes)] = (tokens, steps)
    return counts


def bushy_parents(nodes: int, topk: int) -> list[int]:
    """Parents of a tree of `nodes` nodes filled level by level, each node with topk children."""
    parents, frontier = [], [ROOT]
    while len(parents) < nodes:
        level = []
        for parent in frontier:
            take = min(topk, nodes - len(parents))
            level += range(len(parents), len(parents) + take)
            parents += [parent] * take
        frontier = level
    return parents


def verify_costs(model, config, trees: list, reps: int = 7) -> dict:
    """{(topk, nodes): median time of its verify / of a one-token forward}, after a 128-token
    context: topk 1 is a chain, `forward` of nodes + 1 tokens, as served; else `tree_forward` of a
    bushy tree of as many nodes. Timed round-robin, so load skews no ratio."""
    cache = KVCache(config, max_slots=1, max_seq_len=256, dtype=model.embed.dtype)
    slot = torch.tensor([cache.allocate()])
    ids = torch.randint(0, config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    forward(model, cache, slot, ids[:, :128], torch.tensor([128]))
    times = {(1, 0): []} | {(topk, nodes): [] for topk, _, nodes in trees} | {(1, nodes): [] for _, _, nodes in trees}
    for rep in range(reps + 1):
        for topk, nodes in times:
            start = time.perf_counter()
            if topk == 1:
                forward(model, cache, slot, ids[:, 128:129 + nodes], torch.tensor([nodes + 1]))
            else:
                tree_forward(model, cache, slot, ids[:, 128:129 + nodes], torch.tensor([bushy_parents(nodes, topk)]),
                             torch.tensor([nodes]))
            if rep:
                times[topk, nodes].append(time.perf_counter() - start)
            cache.truncate(int(slot), 128)
    base = statistics.median(times.pop((1, 0)))
    return {key: statistics.median(t) / base for key, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_target_model())
    parser.add_argument("--head", default=str(DEFAULT_EAGLE_HEAD))
    parser.add_argument("--format", default="bfloat16", choices=list(FORMATS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--split", default="held_out", choices=["held_out", "select"], help="eagle's prompts")
    parser.add_argument("--drafter", default="eagle", choices=["eagle", "ngram"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype, weights = FORMATS[args.format]
    tokenizer = load_tokenizer(args.model)
    model, config = load_model(args.model, dtype=dtype, max_seq_len=1024, weights_format=weights)
    trees = TREES if args.drafter == "eagle" else NGRAM_TREES
    costs = verify_costs(model, config, trees)
    totals = {tree: [0, 0] for tree in trees}
    if args.drafter == "eagle":
        head = load_head(args.head, model, max_seq_len=1024)
        prompts = sharegpt_prompts(tokenizer, args.prompts, 256, split=args.split)
    else:
        prompts = [tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": text}]))
                   for _, text in input_grounded_prompts(args.prompts)]
    for prompt in prompts:
        out, features = greedy_continuation(model, config, prompt, args.max_new, tuple(tokenizer.eos_ids))
        counts = (tokens_per_step(head, out, prompt, features, trees) if args.drafter == "eagle"
                  else ngram_tokens_per_step(out, prompt, trees))
        for tree, (tokens, steps) in counts.items():
            totals[tree][0] += tokens
            totals[tree][1] += steps
    chain = totals[trees[0]][0] / totals[trees[0]][1]
    workload = f"{args.split} ShareGPT prompts, head {args.head}" if args.drafter == "eagle" else \
        "input-grounded held-out turns, prompt lookup"
    print(f"{args.model}, {args.format}, {args.threads} thread(s); {args.prompts} {workload}; "
          f"{args.max_new} greedy tokens")
    print("| tree (topk, depth, nodes) | tokens per target step | / first | verify cost / T=1 | a chain of as many "
          "positions | predicted / k=0 |")
    print("|---|---|---|---|---|---|")
    for topk, depth, nodes in trees:
        per_step = totals[topk, depth, nodes][0] / totals[topk, depth, nodes][1]
        cost = costs[topk, nodes]
        print(f"| {(topk, depth, nodes)} | {per_step:.3f} | {per_step / chain:.2f} | {cost:.2f} "
              f"| {costs[1, nodes]:.2f} | {per_step / cost:.2f} |")


if __name__ == "__main__":
    main()
