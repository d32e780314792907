"""Draft and verify batches (schemas/steps.py): a row whose fields disagree is refused, naming the field."""

import time

import msgpack
import pytest

from schemas import (CodecError, DraftResponse, DraftResult, ErrorCode, Proposal, VerifyRequest, VerifyResult, VerifyRow,
                     decode)


def verify_payload(row_overrides: dict, duplicate_row: bool = False) -> bytes:
    """A valid one-row VerifyRequest, its (last) row edited; duplicate_row appends a copy first."""
    good = VerifyRow(request_id="r0", row=0, step=3, cached_len=10, prompt_len=8, draft_token_ids=[5, 6],
                     proposal=Proposal(kind="sparse", ids=[[5, 9], [6, -1]], probs=[[0.75, 0.25], [1.0, 0.0]]))
    raw = VerifyRequest(batch_id=4, scheduler_id="s0", deadline=time.time() + 1, rows=[good]).model_dump()
    if duplicate_row:
        raw["rows"].append(dict(raw["rows"][0]))
    for key, value in row_overrides.items():
        if key.startswith("proposal."):
            raw["rows"][-1]["proposal"][key.removeprefix("proposal.")] = value
        else:
            raw["rows"][-1][key] = value
    return msgpack.packb(raw, use_bin_type=True)


@pytest.mark.parametrize("overrides, field, message", [
    ({"proposal.kind": "gaussian"}, "rows[0].proposal.kind", "'point_mass', 'sparse' or 'dense'"),
    ({"proposal.ids": None}, "rows[0].proposal.ids", "sparse proposal needs ids"),
    ({"proposal.kind": "dense", "proposal.ids": None, "proposal.draft_vocab_size": 3},
     "rows[0].proposal.draft_vocab_size", "draft_vocab_size 3 != probs width 2"),
    ({"proposal.kind": "point_mass"}, "rows[0].proposal.ids", "point_mass proposal carries no ids"),
    ({"draft_token_ids": [5]}, "rows[0].proposal.probs", "2 proposal rows for 1 draft tokens"),
    ({"draft_token_ids": [5, 7]}, "rows[0].proposal.ids", "draft token at position 1 has no probability"),
    ({"draft_token_ids": list(range(17)), "proposal.kind": "point_mass", "proposal.ids": None, "proposal.probs": None},
     "rows[0].draft_token_ids", "at most 16 draft tokens"),
    ({"postprocessor_id": "post.1"}, "rows[0].postprocessor_id", "pattern"),
])
def test_inconsistent_verify_row_names_the_field(overrides, field, message):
    with pytest.raises(CodecError, match=message) as caught:
        decode(verify_payload(overrides), VerifyRequest)
    assert (caught.value.code, caught.value.field) == (ErrorCode.invalid_field, field)


def test_same_request_twice_in_a_batch_is_refused():
    with pytest.raises(CodecError, match="request r0 appears twice") as caught:
        decode(verify_payload({"row": 1}, duplicate_row=True), VerifyRequest)
    assert caught.value.field == "rows[1].request_id"


def test_draft_response_checks_proposals_too():
    row = DraftResult(request_id="r", draft_token_ids=[3])
    raw = DraftResponse(batch_id=1, drafter_id="d0", rows=[row]).model_dump()
    raw["rows"][0]["proposal"] = {"kind": "sparse", "ids": [[4]], "probs": [[1.0]]}
    with pytest.raises(CodecError, match="draft token at position 0 has no probability") as caught:
        decode(msgpack.packb(raw), DraftResponse)
    assert caught.value.field == "rows[0].proposal.ids"


@pytest.mark.parametrize("kwargs, message", [
    ({"token_ids": [1, 2], "num_draft": 2, "num_accepted": 3}, "3 accepted of 2 drafts"),
    ({"token_ids": [1, 2], "num_draft": 4, "num_accepted": 0}, "2 tokens emitted for 0 accepted drafts"),
    ({"token_ids": [], "num_draft": 4, "num_accepted": 1}, "0 tokens emitted for 1 accepted drafts"),
])
def test_verify_result_counts_must_add_up(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VerifyResult(request_id="r", step=0, **kwargs)
