"""The receiver rule and the max_seq_len room (gpu_worker/batching/receiver_rule.py), which the
drafter and the verifier both apply."""

from gpu_worker.batching.receiver_rule import receiver_rule


def test_a_receiver_holding_fewer_than_cached_len_answers_need_resync():
    assert receiver_rule(held=0, cached_len=5, num_new=1, max_seq_len=64).need_resync  # no slot
    assert receiver_rule(held=4, cached_len=5, num_new=1, max_seq_len=64).need_resync
    assert not receiver_rule(held=5, cached_len=5, num_new=1, max_seq_len=64).need_resync
    assert not receiver_rule(held=9, cached_len=5, num_new=1, max_seq_len=64).need_resync  # truncates to 5
    assert not receiver_rule(held=0, cached_len=0, num_new=7, max_seq_len=64).need_resync  # a new request


def test_the_room_is_what_max_seq_len_leaves_after_the_history():
    assert receiver_rule(held=10, cached_len=10, num_new=2, max_seq_len=16).room == 4
    assert receiver_rule(held=10, cached_len=10, num_new=6, max_seq_len=16).room == 0
    assert receiver_rule(held=10, cached_len=10, num_new=7, max_seq_len=16).room == -1  # the history does not fit
    assert receiver_rule(held=0, cached_len=3, num_new=20, max_seq_len=16).room == -7  # whatever the verdict
