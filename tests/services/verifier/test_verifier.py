"""run_verifier against a real nats-server: replies, side records, $SRV.PING, bad messages."""

import asyncio
import json
import time

import pytest
from tokenizers import Tokenizer, models

from schemas.bus.clock import MAX_CLOCK_SKEW_S
from schemas.bus.codec import decode, encode
from schemas.commits import SideChannelRecord
from schemas.config import VerifierConfig, load_config
from schemas.bus.control import Heartbeat
from schemas.errors import ErrorCode
from schemas.generation import LogprobOptions, RowSampling
from schemas.steps import VerifyRequest, VerifyResponse, VerifyRow
from schemas.bus.subjects import Subjects
from schemas.bus.wire import Error
from services.verifier.verifier import run_verifier
from services.runtime.bus import request
from tests.tiny_checkpoints import TINY, write_hf_model

V = TINY["vocab_size"]
PROMPT = [5, 17, 42, 8, 90, 23, 61, 3, 77, 12]
MAX_SLOTS = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    write_hf_model(path, "llama", seed=5)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


def verify_request(*rows, batch_id=1, deadline_s=30.0, release=()):
    return VerifyRequest(batch_id=batch_id, scheduler_id="sched-test", deadline=time.time() + deadline_s,
                         rows=list(rows), release=list(release))


def row(request_id, new_token_ids, cached_len=0, step=0, index=0, prompt_len=len(PROMPT), **kwargs):
    return VerifyRow(request_id=request_id, row=index, step=step, cached_len=cached_len, new_token_ids=new_token_ids,
                     prompt_len=prompt_len, sampling=RowSampling(temperature=0), postprocessor_id="post-1", **kwargs)


async def test_run_verifier_serves_verify_requests_over_nats(nats_server, nc, target_dir):
    config = load_config(VerifierConfig, env={}, nats_url=nats_server.url, target_model=str(target_dir),
                         instance_id="verifier-nats", max_slots=MAX_SLOTS, max_seq_len=64, heartbeat_interval_s=0.05,
                         dtype="float32")
    subjects = Subjects()
    beats: asyncio.Queue = asyncio.Queue()
    side: asyncio.Queue = asyncio.Queue()

    async def on_beat(msg):
        await beats.put(decode(msg.data, Heartbeat))

    async def on_side(msg):
        await side.put(decode(msg.data, SideChannelRecord))

    await nc.subscribe(subjects.heartbeat, cb=on_beat)
    await nc.subscribe(subjects.post_side("post-1"), cb=on_side)
    stop = asyncio.Event()
    task = asyncio.create_task(run_verifier(config, stop))
    beat = await asyncio.wait_for(beats.get(), timeout=30)
    assert (beat.role, beat.instance_id, beat.capacity, beat.free_slots) == ("verifier", "verifier-nats", 3, 3)
    assert set(beat.model_ids) == {"target", "tokenizer", "max_seq_len", "hidden_size", "prefix_caching", "weights"}
    assert beat.model_ids["prefix_caching"] == "on"  # schedulers hint its first chunks by it (prefix_hints.py)

    subject = subjects.verify("verifier-nats")
    sent = verify_request(row("a", PROMPT, logprobs=LogprobOptions(logprobs=2)),
                          row("b", PROMPT[:4], prompt_len=4, index=1), batch_id=7)
    response = decode((await request(nc, subject, encode(sent), timeout_s=30)).data, VerifyResponse)
    assert response.batch_id == 7 and response.verifier_id == "verifier-nats"
    assert [(r.request_id, len(r.token_ids), r.error) for r in response.rows] == [("a", 1, None), ("b", 1, None)]
    record = await asyncio.wait_for(side.get(), timeout=10)  # only "a" asked for logprobs
    assert (record.request_id, record.batch_id, record.verifier_id) == ("a", 7, "verifier-nats")
    assert record.token_ids.tolist() == response.rows[0].token_ids.tolist() and record.logprobs.top_ids.shape == (1, 2)

    malformed = decode((await request(nc, subject, b"\xc1 not msgpack", timeout_s=10)).data, Error)
    assert malformed.code == ErrorCode.malformed
    wrong_type = decode((await request(nc, subject, encode(beat), timeout_s=10)).data, Error)
    assert wrong_type.code == ErrorCode.wrong_message_type and wrong_type.field == "type"
    expired = verify_request(row("c", PROMPT), deadline_s=-(MAX_CLOCK_SKEW_S + 1.0))  # past even a skewed clock's allowance
    late = decode((await request(nc, subject, encode(expired), timeout_s=10)).data, Error)
    assert late.code == ErrorCode.timeout and late.field == "deadline"

    ping = json.loads((await request(nc, "$SRV.PING.verifier", b"", timeout_s=10)).data)
    assert ping["name"] == "verifier"
    # still serving after the bad messages: release "a", then "b" decodes on
    after = verify_request(row("b", [3], cached_len=4, step=1, prompt_len=4), release=["a"],
                           batch_id=8)
    response = decode((await request(nc, subject, encode(after), timeout_s=30)).data, VerifyResponse)
    assert response.rows[0].error is None and len(response.rows[0].token_ids) == 1
    while (beat := await asyncio.wait_for(beats.get(), timeout=10)).free_slots != MAX_SLOTS - 1:
        pass
    stop.set()
    await asyncio.wait_for(task, timeout=15)
