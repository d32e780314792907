"""services/pipeline/fair_share.py: shares, the user to refuse, start order, weights parsing.
Admission through SchedulerState is in test_scheduler_core.py."""

import pytest

from schemas.errors import SpecbusError
from services.pipeline.fair_share import (most_over_share, parse_user_weights, share, start_order_key,
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
