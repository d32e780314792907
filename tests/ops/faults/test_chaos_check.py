"""The chaos checker on hand-made histories: each rule of docs/PROTOCOL.md#guarantees-under-faults
flags what breaks it and passes what keeps it, and a history survives its file."""

from ops.faults.chaos_check import FaultEvent, Record, check, judge, read_history, recovery, write_history


def record(request_id="r-1", spec=0, tokens=(1, 2, 3), text="abc", logprobs=(-0.5, -0.25, -1.0), **fields):
    fields = {"chunks": [(10.0 + i, i, 1) for i in range(len(tokens))], "started": 9.0, "ended": 20.0,
              "finish_reason": "length", **fields}
    return Record(spec, request_id, "client", token_ids=list(tokens), text=text, logprobs=list(logprobs), **fields)


REFERENCE = record("ref")


def test_an_identical_run_passes_and_a_failover_is_told_apart():
    assert judge(record(), REFERENCE) == "identical"
    assert judge(record(degraded=["failover"]), REFERENCE) == "identical-failover"


def test_a_changed_token_text_or_logprob_is_changed():
    assert judge(record(tokens=(1, 2, 4)), REFERENCE) == "changed"
    assert judge(record(text="abd"), REFERENCE) == "changed"
    assert judge(record(logprobs=(-0.5, -0.25, -1.5)), REFERENCE) == "changed"


def test_logprobs_may_be_missing_only_where_flagged():
    held_up = dict(logprobs=(-0.5, None, -1.0))
    assert judge(record(**held_up), REFERENCE) == "changed"
    assert judge(record(degraded=["logprobs_timeout"], **held_up), REFERENCE) == "identical-without-some-logprobs"


def test_a_gap_a_repeat_and_a_request_without_an_end_are_caught():
    assert judge(record(chunks=[(10.0, 0, 1), (11.0, 2, 2)]), REFERENCE) == "gapped"
    assert judge(record(chunks=[(10.0, 0, 1), (11.0, 0, 1), (12.0, 1, 1)]), REFERENCE) == "gapped"
    assert judge(record(ended=None), REFERENCE) == "missing"


def test_a_refusal_before_any_chunk_is_allowed_a_gateway_5xx_after_admission_is_not():
    refused = record(chunks=[], tokens=(), text="", logprobs=(), error_code="unavailable")
    assert judge(refused, REFERENCE) == "refused"
    assert judge(record(http_status=502, error_code="502"), REFERENCE) == "5xx"
    verdict = check([record(), refused, record("r-2", error_code="timeout")], {0: REFERENCE}, [])
    assert not verdict.ok and verdict.counts["refused"] == 1 and len(verdict.problems) == 1
    assert check([record(), refused], {0: REFERENCE}, []).ok


def test_typed_errors_are_allowed_only_when_asked():
    timed_out = record(error_code="timeout", error="deadline passed")
    assert not check([timed_out], {0: REFERENCE}, []).ok
    assert check([timed_out], {0: REFERENCE}, [], allow_errors=True).ok
    assert not check([record(error_code="untyped")], {0: REFERENCE}, [], allow_errors=True).ok


def test_recovery_is_the_wait_from_the_heal_to_each_held_stream_s_next_chunk():
    fault = FaultEvent("cut-verifier", ["verifier-0"], began=10.5, healed=13.0)
    held = record(chunks=[(10.0, 0, 1), (14.0, 1, 1), (15.0, 2, 1)])
    quick = record("r-2", chunks=[(10.0, 0, 1), (13.5, 1, 1), (13.6, 2, 1)])
    later = record("r-3", started=11.0)  # started after the fault began: not counted
    measured = recovery(fault, [held, quick, later])
    assert measured["in_flight"] == 2 and measured["recover_s"] == 1.0 and measured["recover_median_s"] == 0.75
    assert measured["first_token_s"] == 3.0


def test_a_history_reads_back_as_written(tmp_path):
    records, faults = [record(), record("r-2", logprobs=(None, None, None))], [FaultEvent("stall-node", ["nats-1"], 10.2, 12.0)]
    write_history(tmp_path / "history.jsonl", records, faults, {0: REFERENCE})
    assert read_history(tmp_path / "history.jsonl") == (records, faults, {0: REFERENCE})
