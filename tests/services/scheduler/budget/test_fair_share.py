"""services/scheduler/budget/fair_share.py: shares, the user to refuse, start order, weights parsing.
Admission through SchedulerState is in test_scheduler_core.py."""

import pytest

from schemas.errors import SpecbusError
from services.scheduler.budget.fair_share import (most_over_share, parse_user_weights, prefill_caps, share, split_fairly,
                                          start_order_key,
                                          user_of_inbox)


def test_a_lone_user_may_use_everything_and_a_newcomer_gets_its_part_at_once():
    assert share("alice", {"alice": 9}, {}, 10) == 10
    assert share("bob", {"alice": 9}, {}, 10) == 5
    assert share("alice", {"alice": 9}, {}, 10, arriving="bob") == 5
    assert share("alice", {"alice": 9}, {"alice": 3}, 8, arriving="bob") == 6


def test_the_user_furthest_over_its_share_with_a_queued_request_gives_way():
    loads = {"alice": 6, "carol": 3, "bob": 0}
    assert most_over_share("bob", loads, ["alice", "carol"], {}, 9) == "alice"
    assert most_over_share("bob", loads, ["carol"], {}, 9) is None  # carol holds exactly her 3
    assert most_over_share("bob", loads, ["alice"], {"alice": 4}, 9) is None  # alice's share is 6


def test_start_order_prefers_the_fewest_running_per_weight():
    key = start_order_key({"alice": 2, "bob": 1}, {"alice": 4})
    assert sorted(["alice", "bob", "carol"], key=key) == ["carol", "alice", "bob"]


def test_weights_and_inboxes_parse():
    assert parse_user_weights(" alice=2, bob=0.5 ,") == {"alice": 2.0, "bob": 0.5}
    for bad in ("alice", "alice=x", "=2", "alice=-1", "alice=inf"):
        with pytest.raises(SpecbusError, match="user_weights"):
            parse_user_weights(bad)
    assert user_of_inbox("_INBOX.alice.abc.1") == "alice" and user_of_inbox("_INBOX.x") == ""


def test_prefill_room_is_split_max_min_fair_by_weight():
    """A user asking less than its slice gets what it asks; the others share the rest by weight;
    every token of the room is given while anyone asks for more."""
    assert split_fairly({"alice": 5, "bob": 4000}, {}, 200) == {"alice": 5, "bob": 195}
    assert split_fairly({"alice": 4000, "bob": 4000}, {}, 201) == {"alice": 101, "bob": 100}
    assert split_fairly({"alice": 4000, "bob": 4000}, {"alice": 3}, 200) == {"alice": 150, "bob": 50}
    assert split_fairly({"alice": 10, "bob": 20}, {}, 100) == {"alice": 10, "bob": 20}
    assert split_fairly({"alice": 0, "bob": 50}, {}, 10) == {"alice": 0, "bob": 10}


def test_prefill_parity_caps_a_user_while_another_users_rows_decode():
    """While alice's rows decode in the step (5 tokens), bob's prefill takes at most as many, or
    the floor; a user whose own rows alone decode is not capped."""
    shares = {"alice": 0, "bob": 195}
    assert prefill_caps(shares, {"alice": 5}, 32) == {"alice": 0, "bob": 32}
    assert prefill_caps(shares, {"alice": 80}, 32) == {"alice": 0, "bob": 80}
    assert prefill_caps(shares, {"bob": 5}, 32) == shares
    assert prefill_caps(shares, {}, 32) == shares
