"""Commits and side-channel records (schemas/commits.py): counts add up, processed logprobs carry logz_k."""

import msgpack
import numpy as np
import pytest

from schemas import CodecError, Commit, LogprobArrays, SideChannelRecord, decode


def test_processed_side_channel_needs_logz_k():
    raw = SideChannelRecord(request_id="r", batch_id=1, step=0, verifier_id="v0", mode="raw", token_ids=[3],
                            logprobs=LogprobArrays(token_logprobs=[-0.5], top_ids=np.zeros((1, 0), np.int32),
                                                   top_logprobs=np.zeros((1, 0)), requested_logprobs=np.zeros((1, 0)))
                            ).model_dump()
    raw["mode"] = "processed"
    with pytest.raises(CodecError, match="processed mode needs logz_k") as caught:
        decode(msgpack.packb(raw), SideChannelRecord)
    assert caught.value.field == "logprobs.logz_k"


def test_commit_counts_must_add_up():
    with pytest.raises(ValueError, match="5 accepted of 4 drafts"):
        Commit(request_id="r", batch_id=1, step=0, seq=0, scheduler_id="s0", client_inbox="_INBOX.x",
               num_draft=4, num_accepted=5)
