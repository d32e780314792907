"""The suffix index (services/scheduler/drafts/suffix_index.py): proposals from the longest earlier match,
frequency-weighted; bounded memory with least-recently-used eviction; tenants apart."""

import random
import sys

import pytest

from services.scheduler.drafts.suffix_index import KEY_LENGTHS, SuffixIndex, SuffixPools


def indexed(*sequences, max_tokens=10_000):
    index = SuffixIndex(max_tokens)
    ids = []
    for tokens in sequences:
        ids.append(index.add())
        index.extend(ids[-1], list(tokens))
    return index, ids


def test_a_chain_continues_the_longest_match_most_frequent_first():
    index, _ = indexed([1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 8], [0, 2, 3, 4, 7, 8])
    proposal = index.propose([3, 4], 8, 0.0)
    # "3 4" went on with 7 twice and 5 once: 7 first, probability 2/3, then 8 (both 7s went on so)
    assert proposal.token_ids == [7, 8] and proposal.probs == pytest.approx([2 / 3, 2 / 3])
    # a longer match is more specific: "1 2 3 4" occurred once, followed by 5 6
    longer = index.propose([1, 2, 3, 4], 8, 0.0)
    assert longer.token_ids == [5, 6] and longer.match_len == 4 and longer.probs == [1.0, 1.0]


def test_min_prob_and_max_drafts_end_a_chain():
    index, _ = indexed([1, 2, 5, 6], [1, 2, 7, 8], [1, 2, 9, 9])
    assert index.propose([1, 2], 8, 0.4).token_ids == []  # each continuation a third: under 0.4
    assert index.propose([1, 2], 8, 0.3).token_ids == [9, 9]  # the most recent of a tie
    assert index.propose([1, 2], 1, 0.0).token_ids == [9]
    assert index.propose([1, 2], 0, 0.0).token_ids == []
    assert index.propose([42], 8, 0.0).token_ids == []  # never seen


def test_the_own_history_is_matched_and_reads_on_into_its_drafts():
    index, (own,) = indexed([5, 1, 2, 3, 1, 2])
    # prompt lookup: "1 2" occurred before in the request itself; a period repeats past its end
    assert index.propose([5, 1, 2, 3, 1, 2], 7, 0.0, own=own).token_ids == [3, 1, 2, 3, 1, 2, 3]


def test_a_tree_holds_several_continuations_best_first():
    index, _ = indexed([1, 2, 5, 6], [1, 2, 7, 8], [1, 2, 7, 9])
    tree = index.propose_tree([1, 2], 4, 2, 0.0)
    # 7 (2/3) with children 9 and 8 (1/3 each, 9 more recent), and 5 (1/3): the four best nodes
    assert tree.token_ids == [7, 9, 8, 5] and tree.parents == [-1, 0, 0, -1]
    assert tree.probs == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert index.propose_tree([1, 2], 8, 1, 0.0).token_ids == [7, 5]  # depth 1: the children of the root


def test_memory_is_bounded_by_tokens_least_recently_used_out():
    index, (a, b, c) = indexed([1, 2, 3], [4, 5, 6], [7, 8, 9], max_tokens=8)
    # a was the least recently used: 9 tokens > 8, so it went
    assert not index.alive(a) and index.alive(b) and index.alive(c) and index.num_tokens == 6
    assert index.propose([1, 2], 4, 0.0).token_ids == []
    index.extend(b, [10])  # b is now the most recent: c goes when d comes
    d = index.add()
    index.extend(d, [11, 12])
    assert index.alive(b) and not index.alive(c) and index.num_tokens == 6
    # one sequence alone is never indexed past the budget
    e = index.add()
    assert index.extend(e, list(range(100, 120))) == 8 and index.num_tokens == 8


def test_evicted_occurrences_are_compacted_so_entries_stay_bounded():
    rng = random.Random(0)
    index = SuffixIndex(max_tokens=500)
    for _ in range(200):
        sid = index.add()
        index.extend(sid, [rng.randrange(50) for _ in range(rng.randrange(5, 60))])
        assert index.num_tokens <= 500
        assert index.num_entries <= 2 * len(KEY_LENGTHS) * 500 + len(KEY_LENGTHS) * 60
    live = sum(len(e) for e in index.occurrences.values())
    assert live == index.num_entries and index.evicted > 100
    # what is left proposes as an index built from the live sequences alone
    rebuilt, _ = indexed(*index.sequences.values())
    for seq in list(index.sequences.values())[-5:]:
        assert index.propose(seq[:10], 6, 0.0).token_ids == rebuilt.propose(seq[:10], 6, 0.0).token_ids
    assert sys.getsizeof(index.occurrences) < 10 ** 6


def traffic(rng, n):
    return [[rng.randrange(20) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("max_tokens", [64, 10_000])
def test_one_tenants_traffic_never_changes_another_tenants_drafts(max_tokens):
    rng = random.Random(1)
    bob_requests, alice_requests, queries = traffic(rng, 30), traffic(rng, 200), traffic(rng, 40)

    def bob_drafts(with_alice: bool) -> list[list[int]]:
        pools = SuffixPools(max_tokens)
        drafts = []
        for i, tokens in enumerate(bob_requests):
            if with_alice:  # alice's traffic between each of bob's requests, under the same budget
                for j, other in enumerate(alice_requests[i * 6:(i + 1) * 6]):
                    pools.ended(f"a{i}-{j}", "alice", other)
            pools.ended(f"b{i}", "bob", tokens)
        for i, query in enumerate(queries):
            drafts.append(pools.propose(f"q{i}", "bob", query, 8, 0.0).token_ids)
        return drafts

    alone = bob_drafts(with_alice=False)
    assert any(alone)  # bob's own traffic does draft
    assert bob_drafts(with_alice=True) == alone


def test_a_shared_pool_drafts_from_everyones_traffic():
    shared, apart = SuffixPools(1000, shared=True), SuffixPools(1000)
    for pools in (shared, apart):
        pools.ended("a1", "alice", [1, 2, 3, 4, 5])
    assert shared.propose("b1", "bob", [2, 3], 4, 0.0).token_ids == [4, 5]
    assert apart.propose("b1", "bob", [2, 3], 4, 0.0).token_ids == []


def test_a_request_is_synced_as_it_grows_and_restarts_when_evicted():
    pools = SuffixPools(max_tokens=12)
    history = [1, 2, 3]
    pools.sync("r", "u", history)
    history += [1, 2]
    assert pools.propose("r", "u", history, 4, 0.0).token_ids == [3, 1, 2, 3]
    index = pools.index("u")
    assert index.num_tokens == 5
    pools.ended("other", "u", list(range(50, 60)))  # 15 tokens > 12: r, the least recent, goes
    assert index.num_tokens == 10
    history += [3]
    pools.sync("r", "u", history)  # indexed again from the start
    assert index.num_tokens == 6 and "r" in pools.seqs
