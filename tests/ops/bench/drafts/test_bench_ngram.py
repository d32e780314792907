"""ops/bench/drafts/bench_ngram.py's offline replay by hand (the run itself needs SmolLM2 and minutes),
and its workload filter on made-up turns."""

from ops.bench.drafts.bench_ngram import INPUT_GROUNDED, replay


def test_replay_counts_steps_as_the_stack_does():
    # the prefill step emits 1 (no drafts); then [1] was seen at 0: drafts 2, 3, 4, 5 (as many as
    # fit before the last token), all accepted, and the target's token: 5 tokens in one step
    assert replay([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], k=4, max_n=4, min_n=1) == \
        {"steps": 2, "proposed": 4, "accepted": 4}
    # min_n 2: [5, 1] was never seen, so nothing; then [1, 2] was: draft 3, accepted, then 9
    assert replay([1, 2, 3, 4, 5], [1, 2, 3, 9], k=4, max_n=4, min_n=2) == {"steps": 3, "proposed": 1, "accepted": 1}
    # the most recent 7 was followed by 6: rejected, the step still emits the target's 9
    assert replay([7, 8, 7, 6], [5, 7, 9, 1], k=4, max_n=4, min_n=1) == {"steps": 4, "proposed": 1, "accepted": 0}


def test_the_filter_wants_a_request_to_work_on_given_text():
    assert INPUT_GROUNDED.search("Please rewrite this paragraph")
    assert INPUT_GROUNDED.search("can you translate this glsl shader method to hlsl?")
    assert INPUT_GROUNDED.search("correct this sentence")
    assert not INPUT_GROUNDED.search("include the correct answer for each question")
    assert not INPUT_GROUNDED.search("What is the capital of France?")
