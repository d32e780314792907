"""ops/bench/bench_overload.py's split of the decoding streams' chunk gaps into before and during
the burst: a gap counts where its later chunk arrived."""

from ops.bench.bench_overload import gaps_ending


def test_a_gap_belongs_to_the_window_its_later_chunk_arrived_in():
    streams = [[1.0, 1.1, 1.2, 2.5, 3.0], [1.05, 2.0, 2.1]]
    assert sorted(round(g, 2) for g in gaps_ending(streams, 1.0, 2.0)) == [0.1, 0.1, 0.95]
    assert sorted(round(g, 2) for g in gaps_ending(streams, 2.0, 3.0)) == [0.1, 0.5, 1.3]
    assert gaps_ending(streams, 3.0, 9.0) == []
