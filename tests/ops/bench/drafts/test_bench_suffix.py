"""bench_suffix's offline replay (ops/bench/drafts/bench_suffix.py): exact scoring of suffix drafts over
recorded outputs, our rule against ArcticInference's."""

from ops.bench.drafts.bench_suffix import replay


def parse(score: str) -> tuple[float, float]:
    tokens, drafts = score.split()
    return float(tokens), float(drafts.strip("()"))


def test_a_repeated_answer_is_drafted_whole_and_a_new_one_not_at_all():
    answer = list(range(100, 124))
    histories = [([1, 2, 3], answer), ([1, 2, 3], answer)]
    tokens, drafts = parse(replay(histories, 8, arctic=False))
    # the first answer is new (one token a step, 24 steps), the second seen whole: 9 tokens a step
    # (8 drafts, all accepted, and the target's), 24 in 3 steps: 48 tokens in 27 steps
    assert tokens == round(48 / 27, 2) and drafts > 0
    arctic_tokens, arctic_drafts = parse(replay(histories, 8, arctic=True))
    assert arctic_tokens <= tokens and arctic_drafts <= drafts  # at most the match's length
    assert parse(replay([([1, 2, 3], answer)], 8, arctic=False)) == (1.0, 0.0)
