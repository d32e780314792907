"""ops/bench/inprocess.py: the one-process loop runs requests to their end on the tiny pair."""

from ops.bench.inprocess import load_inprocess, run_requests
from schemas.config import TINY_DRAFT, TINY_TARGET
from services.client import make_request


def test_one_slot_serves_requests_one_after_another():
    # the second request waits for the first one's slot, freed by a release-only batch
    loop = load_inprocess(str(TINY_TARGET), str(TINY_DRAFT), max_slots=1)
    requests = [make_request([5, 6, 7, 8 + i], max_tokens=6, ignore_eos=True) for i in range(3)]
    run = run_requests(loop, requests, concurrency=1)
    for request in requests:
        chunks = run.chunks[request.request_id]
        assert chunks[-1].final and chunks[-1].finish_reason == "length"
        assert sum(len(chunk.token_ids) for chunk in chunks) == 6
