"""Subject names (docs/PROTOCOL.md#subjects) under a configurable prefix; ids cannot widen a subject."""

import pytest

from schemas import SCHEDULER_QUEUE_GROUP, ErrorCode, SpecbusError, Subjects


def test_default_subjects():
    subjects = Subjects()
    assert subjects.generate == "specbus.generate"
    assert subjects.cancel == "specbus.cancel"
    assert subjects.generate_for("alice") == "specbus.generate.alice"
    assert subjects.cancel_for("bob") == "specbus.cancel.bob"
    assert subjects.user_of("specbus.cancel.bob") == "bob"
    assert subjects.heartbeat == "specbus.heartbeat"
    assert subjects.draft("drafter-0") == "specbus.draft.drafter-0"
    assert subjects.verify("gpu_1") == "specbus.verify.gpu_1"
    assert subjects.post_commit("pp0") == "specbus.post.pp0.commit"
    assert subjects.post_side("pp0") == "specbus.post.pp0.side"
    assert subjects.stop_notice("sched-a") == "specbus.stop.sched-a"
    assert SCHEDULER_QUEUE_GROUP == "schedulers"


def test_custom_prefix():
    subjects = Subjects("prod.eu-1")
    assert subjects.generate == "prod.eu-1.generate"
    assert subjects.verify("v0") == "prod.eu-1.verify.v0"


@pytest.mark.parametrize("bad_id", ["a.b", "a b", "*", ">", "v*", "", "x" * 65, "tab\t"])
def test_ids_that_would_change_the_subject_are_refused(bad_id):
    with pytest.raises(SpecbusError, match="not a valid id") as caught:
        Subjects().verify(bad_id)
    assert (caught.value.code, caught.value.field) == (ErrorCode.invalid_field, "verifier_id")


@pytest.mark.parametrize("bad_prefix", ["", "a..b", ".a", "a.", "spec bus", "specbus.>", "*"])
def test_bad_prefix_is_refused(bad_prefix):
    with pytest.raises(SpecbusError, match="not a valid subject prefix") as caught:
        Subjects(bad_prefix)
    assert caught.value.field == "prefix"
