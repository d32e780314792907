"""Postprocessor: the join/format/detokenize logic without NATS, then the service over a real
nats-server driven by hand-made Commits and SideChannelRecords, read with the real Client."""

import asyncio
import contextlib
import json
import math
import time

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from text.tokenizer import load_tokenizer
from schemas.bus.codec import decode, encode
from schemas.commits import Commit, LogprobArrays, SideChannelRecord, StopNotice
from schemas.config import PostprocessorConfig, load_config
from schemas.bus.control import Heartbeat
from schemas.generation import GenerateRequest, LogprobOptions
from schemas.streams import SamplingMask, Usage
from services.client import Client, make_request
from services.postprocessor.postprocessor import run_postprocessor
from services.postprocessor.postprocessor_core import ChunkToClient, NoticeToScheduler, Postprocessor
from services.runtime.bus import BusNoResponders, connect, request

NEG_INF = -math.inf
TIMEOUT = 0.5  # side_channel_timeout_s of the logic tests


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A real byte-level BPE tokenizer, trained on a few words (so other text stays in bytes)."""
    path = tmp_path_factory.mktemp("tokenizer")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(["hello world abc STOP xyz the quick brown fox"] * 10, trainer)
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture
def post(tokenizer):
    return Postprocessor(tokenizer, "post-a", side_channel_timeout_s=TIMEOUT)


def commit(seq, token_ids, *, request_id="r1", batch_id=None, num_accepted=0, **fields):
    """Commit seq of request_id; batch_id defaults to 10 + seq (batch ids need not start at 0)."""
    fields.setdefault("client_inbox", "_INBOX.client")
    return Commit(request_id=request_id, batch_id=10 + seq if batch_id is None else batch_id, step=seq, seq=seq,
                  scheduler_id="sched-1", token_ids=token_ids,
                  num_draft=max(num_accepted, 1 if len(token_ids) else 0), num_accepted=num_accepted, **fields)


def arrays(n, *, top=3, requested=1, logz_k=None, seed=0):
    """LogprobArrays for n positions; logprobs of ids top_ids are -(rank), so they are easy to check."""
    rng = np.random.default_rng(seed)
    top_ids = np.array([rng.permutation(50)[:top] for _ in range(n)], np.int32).reshape(n, top)
    return LogprobArrays(token_logprobs=-rng.random(n).astype(np.float32),
                         top_ids=top_ids, top_logprobs=-np.tile(np.arange(1, top + 1, dtype=np.float32), (n, 1)),
                         requested_logprobs=-rng.random((n, requested)).astype(np.float32),
                         ranks=np.arange(1, n + 1, dtype=np.int32), logz_k=logz_k)


def record(token_ids, *, request_id="r1", batch_id, mode="raw", logprobs=None, masks=None, **fields):
    return SideChannelRecord(request_id=request_id, batch_id=batch_id, step=0, verifier_id="verifier-1", mode=mode,
                             token_ids=token_ids, logprobs=logprobs if logprobs is not None else arrays(len(token_ids)),
                             masks=masks, **fields)


def chunks(outs):
    return [out.chunk for out in outs if isinstance(out, ChunkToClient)]


def notices(outs):
    return [out.notice for out in outs if isinstance(out, NoticeToScheduler)]


WANTS_LOGPROBS = dict(expect_side_channel=True, logprobs=LogprobOptions(logprobs=2))


# ---------------------------------------------------------------------------------------------
# join


def test_record_before_commit_joins_at_once(post, tokenizer):
    ids = tokenizer.encode("hello world")
    assert post.on_side(record(ids, batch_id=10), now=0.0) == []
    [chunk] = chunks(post.on_commit(commit(0, ids, **WANTS_LOGPROBS), now=0.1))
    assert chunk.seq == 0 and chunk.text == "hello world" and chunk.degraded == []
    assert [entry.token_id for entry in chunk.logprobs] == ids
    assert [entry.token for entry in chunk.logprobs] == ["hello", " world"]


def test_commit_waits_for_its_record_then_joins(post, tokenizer):
    ids = tokenizer.encode("hello world")
    assert post.on_commit(commit(0, ids, **WANTS_LOGPROBS), now=0.0) == []
    assert post.on_tick(now=TIMEOUT / 2) == []
    [chunk] = chunks(post.on_side(record(ids, batch_id=10), now=TIMEOUT * 0.9))
    assert chunk.logprobs is not None and chunk.degraded == []
    assert post.counters.logprobs_timeouts == 0


def test_missing_record_times_out_and_a_late_one_is_dropped(post, tokenizer):
    ids = tokenizer.encode("hello world")
    post.on_commit(commit(0, ids, **WANTS_LOGPROBS), now=0.0)
    assert post.on_tick(now=TIMEOUT * 0.99) == []
    [chunk] = chunks(post.on_tick(now=TIMEOUT))
    assert chunk.logprobs is None and chunk.degraded == ["logprobs_timeout"]
    assert chunk.text == "hello world"
    assert post.on_side(record(ids, batch_id=10), now=TIMEOUT + 0.1) == []
    assert post.counters.late_records == 1 and post.counters.logprobs_timeouts == 1


def test_a_waiting_commit_holds_back_the_next_one(post, tokenizer):
    first, second = tokenizer.encode("hello"), tokenizer.encode(" world")
    post.on_commit(commit(0, first, **WANTS_LOGPROBS), now=0.0)
    assert post.on_commit(commit(1, second, **WANTS_LOGPROBS), now=0.1) == []
    post.on_side(record(second, batch_id=11), now=0.2)
    sent = chunks(post.on_side(record(first, batch_id=10), now=0.3))
    assert [chunk.seq for chunk in sent] == [0, 1]
    assert "".join(chunk.text for chunk in sent) == "hello world"


def test_duplicate_commit_and_record_are_dropped_and_counted(post, tokenizer):
    ids = tokenizer.encode("hello")
    post.on_side(record(ids, batch_id=10), now=0.0)
    assert post.on_side(record(ids, batch_id=10), now=0.0) == []  # before its commit
    assert len(chunks(post.on_commit(commit(0, ids, **WANTS_LOGPROBS), now=0.1))) == 1
    assert post.on_commit(commit(0, ids, **WANTS_LOGPROBS), now=0.2) == []
    assert post.on_side(record(ids, batch_id=10), now=0.2) == []  # a verifier retry re-publishes
    assert post.counters.duplicate_commits == 1 and post.counters.duplicate_records == 2


def test_out_of_order_commits_are_sent_in_seq_order(post, tokenizer):
    assert post.on_commit(commit(1, tokenizer.encode(" world")), now=0.0) == []
    sent = chunks(post.on_commit(commit(0, tokenizer.encode("hello")), now=0.01))
    assert [(chunk.seq, chunk.text) for chunk in sent] == [(0, "hello"), (1, " world")]


def test_a_gap_that_never_fills_ends_the_request_with_an_error(post, tokenizer):
    post.on_commit(commit(0, tokenizer.encode("hello")), now=0.0)
    post.on_commit(commit(2, tokenizer.encode("abc")), now=0.1)
    outs = post.on_tick(now=0.1 + post.gap_timeout_s + 0.01)
    [chunk] = chunks(outs)
    assert chunk.seq == 1 and chunk.finish_reason == "error" and chunk.error.code == "unavailable"
    assert "commit 1" in chunk.error.message
    assert [notice.reason for notice in notices(outs)] == ["error"]
    assert post.counters.missing_commits == 1 and post.load == 0


def test_record_for_an_unknown_request_expires_and_is_counted(post, tokenizer):
    post.on_side(record(tokenizer.encode("hello"), request_id="ghost", batch_id=3), now=0.0)
    post.on_tick(now=post.record_ttl_s + 1)
    assert post.counters.unjoined_records == 1 and len(post.early) == 0


def test_record_that_does_not_match_its_commit_is_not_used(post, tokenizer):
    post.on_side(record(tokenizer.encode("abc"), batch_id=10), now=0.0)
    [chunk] = chunks(post.on_commit(commit(0, tokenizer.encode("hello"), **WANTS_LOGPROBS), now=0.0))
    assert chunk.logprobs is None and chunk.degraded == ["logprobs_invalid"]
    assert post.counters.invalid_records == 1


# ---------------------------------------------------------------------------------------------
# formatting


def test_raw_logprobs_are_passed_as_they_are(post):
    data = arrays(2, top=3)
    post.on_side(record([5, 7], batch_id=10, logprobs=data), now=0.0)
    options = LogprobOptions(logprobs=2, logprob_token_ids=[9])
    [chunk] = chunks(post.on_commit(commit(0, [5, 7], num_accepted=1, expect_side_channel=True, logprobs=options),
                                    now=0.0))
    first = chunk.logprobs[0]
    assert first.logprob == pytest.approx(float(data.token_logprobs[0]))
    assert first.top == [(int(data.top_ids[0, 0]), -1.0), (int(data.top_ids[0, 1]), -2.0)]  # top-2 of 3 sent
    assert first.requested_logprobs.tolist() == pytest.approx(data.requested_logprobs[0].tolist())
    assert [entry.rank for entry in chunk.logprobs] == [1, 2]
    assert chunk.from_draft == [True, False]


def test_processed_logprobs_subtract_logz_k_and_are_minus_inf_outside_the_mask(post):
    logz_k = np.array([-0.5, -0.25], np.float32)
    data = LogprobArrays(token_logprobs=np.array([-1.0, -2.0], np.float32),
                         top_ids=np.array([[5, 6, -1], [7, 3, 8]], np.int32),
                         top_logprobs=np.array([[-1.0, -1.5, NEG_INF], [-2.0, -3.0, -4.0]], np.float32),
                         requested_logprobs=np.array([[-1.5, -9.0], [-3.0, -8.0]], np.float32), logz_k=logz_k)
    masks = [SamplingMask(token_ids=[5, 6], size=2), SamplingMask(all_tokens=True, size=300)]
    post.on_side(record([5, 7], batch_id=10, mode="processed", logprobs=data, masks=masks), now=0.0)
    options = LogprobOptions(logprobs=3, logprobs_mode="processed", logprob_token_ids=[6, 9], sampling_mask=True)
    [chunk] = chunks(post.on_commit(commit(0, [5, 7], expect_side_channel=True, logprobs=options), now=0.0))
    first, second = chunk.logprobs
    assert first.logprob == pytest.approx(-0.5)
    assert first.top == [(5, pytest.approx(-0.5)), (6, pytest.approx(-1.0))]  # the -1 padding is dropped
    assert first.requested_logprobs.tolist() == [pytest.approx(-1.0), NEG_INF]  # 9 is outside K = {5, 6}
    assert second.logprob == pytest.approx(-1.75)
    assert second.requested_logprobs.tolist() == pytest.approx([-2.75, -7.75])  # K = all: nothing cut
    assert chunk.sampling_masks[0].token_ids.tolist() == [5, 6]
    assert chunk.sampling_masks[1].all_tokens and len(chunk.sampling_masks[1].token_ids) == 0


def test_mask_only_request_gets_masks_and_no_logprobs(post):
    post.on_side(record([5], batch_id=10, masks=[SamplingMask(all_tokens=True, size=300)]), now=0.0)
    options = LogprobOptions(sampling_mask=True)
    [chunk] = chunks(post.on_commit(commit(0, [5], expect_side_channel=True, logprobs=options), now=0.0))
    assert chunk.logprobs is None and chunk.sampling_masks[0].all_tokens


def test_prompt_logprobs_come_from_every_prefill_chunk_on_the_first_chunk(post, tokenizer):
    prompt = [11, 12, 13, 14, 15]
    options = LogprobOptions(prompt_logprobs=1, logprobs=0)
    # prefill in two chunks: positions 1-2 (no tokens emitted), then 3-4 with the first token
    post.on_side(record([], batch_id=4, logprobs=arrays(0), prompt_logprobs=arrays(2, seed=1), prompt_offset=1),
                 now=0.0)
    first = commit(0, [20], batch_id=5, expect_side_channel=True, logprobs=options, prompt_token_ids=prompt)
    assert post.on_commit(first, now=0.0) == []
    tail = arrays(2, seed=2)
    [chunk] = chunks(post.on_side(record([20], batch_id=5, prompt_logprobs=tail, prompt_offset=3), now=0.1))
    assert chunk.prompt_token_ids.tolist() == prompt
    assert chunk.prompt_logprobs[0] is None
    assert [entry.token_id for entry in chunk.prompt_logprobs[1:]] == prompt[1:]
    assert chunk.prompt_logprobs[4].logprob == pytest.approx(float(tail.token_logprobs[1]))
    assert len(chunk.prompt_logprobs[4].top_ids) == 1
    assert chunk.degraded == []


def test_scoring_request_ends_with_prompt_logprobs_and_no_tokens(post):
    options = LogprobOptions(prompt_logprobs=0)
    post.on_side(record([], batch_id=3, logprobs=arrays(0), prompt_logprobs=arrays(2), prompt_offset=1), now=0.0)
    final = commit(0, [], batch_id=3, expect_side_channel=True, logprobs=options, prompt_token_ids=[1, 2, 3],
                   finish_reason="length", usage=Usage(prompt_tokens=3, steps=1))
    [chunk] = chunks(post.on_commit(final, now=0.0))
    assert chunk.final and len(chunk.token_ids) == 0 and chunk.text == ""
    assert chunk.prompt_logprobs[0] is None and [e.token_id for e in chunk.prompt_logprobs[1:]] == [2, 3]
    assert chunk.usage.prompt_tokens == 3 and chunk.usage.completion_tokens == 0


# ---------------------------------------------------------------------------------------------
# text


def test_stop_string_across_two_chunks_truncates_exactly(post, tokenizer):
    first, second = tokenizer.encode("abc ST"), tokenizer.encode("OP xyz")
    [chunk0] = chunks(post.on_commit(commit(0, first, stop=["STOP"]), now=0.0))
    assert chunk0.text == "abc"  # " ST" is held back: it may start a stop string
    outs = post.on_commit(commit(1, second, stop=["STOP"]), now=0.1)
    [chunk1] = chunks(outs)
    assert chunk1.finish_reason == "stop" and chunk1.text == " "
    kept = first + chunk1.token_ids.tolist()
    assert tokenizer.decode(kept).startswith("abc STOP") and "STOP" not in tokenizer.decode(kept[:-1])
    assert chunk1.usage.completion_tokens == len(kept)
    assert chunk1.usage.speculative_lengths == [0, 2]  # tallied here: two commits of one draft each
    [notice] = notices(outs)
    assert (notice.reason, notice.stop, notice.text_offset, notice.num_tokens) == ("stop", "STOP", 4, len(kept))
    assert (notice.request_id, notice.postprocessor_id, notice.batch_id) == ("r1", "post-a", 11)
    assert post.on_commit(commit(2, tokenizer.encode("more")), now=0.2) == []
    assert post.counters.ignored_commits == 1


def test_stop_string_in_the_final_commit_overrides_its_finish_reason(post, tokenizer):
    outs = post.on_commit(commit(0, tokenizer.encode("hello STOP world"), stop=["STOP"], finish_reason="length"), 0.0)
    [chunk] = chunks(outs)
    assert chunk.text == "hello " and chunk.finish_reason == "stop"
    assert notices(outs) == []  # the scheduler has finished the request already


def test_multibyte_text_split_across_chunks_streams_whole_characters(post, tokenizer):
    text = "é€🙂 hello"
    ids = tokenizer.encode(text)
    pieces = [ids[0:1], ids[1:3], ids[3:6], ids[6:]]
    sent = []
    for seq, piece in enumerate(pieces):
        final = dict(finish_reason="length") if seq == len(pieces) - 1 else {}
        sent += chunks(post.on_commit(commit(seq, piece, **final), now=0.0))
    assert [chunk.text for chunk in sent] == ["", "é", "€", "🙂 hello"]
    assert "".join(chunk.text for chunk in sent) == tokenizer.decode(ids)


def test_resume_continues_text_and_seq_without_gap(tokenizer):
    ids = tokenizer.encode("hello world abc é€ xyz STOP the end")
    pieces = [ids[0:2], ids[2:4], ids[4:7], ids[7:9], ids[9:]]

    def run(postprocessor, seqs, resume=None):
        sent = []
        for seq in seqs:
            extra = dict(finish_reason="length") if seq == len(pieces) - 1 else {}
            if seq == seqs[0] and resume is not None:
                extra["resume_token_ids"] = resume
            sent += chunks(postprocessor.on_commit(commit(seq, pieces[seq], stop=["STOP"], **extra), now=0.0))
        return sent

    alone = run(Postprocessor(tokenizer, "post-a"), range(len(pieces)))
    before = run(Postprocessor(tokenizer, "post-a"), range(3))  # then post-a dies
    after = run(Postprocessor(tokenizer, "post-b"), range(3, len(pieces)), resume=sum(pieces[:3], []))
    assert [chunk.seq for chunk in before + after] == list(range(len(alone)))
    assert [chunk.text for chunk in before + after] == [chunk.text for chunk in alone]
    assert "".join(chunk.text for chunk in alone) == "hello world abc é€ xyz "
    assert after[-1].finish_reason == "stop"


def test_final_chunk_carries_the_scheduler_usage_plus_logprobs_timeouts(post, tokenizer):
    post.on_commit(commit(0, tokenizer.encode("hello"), **WANTS_LOGPROBS), now=0.0)
    post.on_tick(now=TIMEOUT)
    usage = Usage(prompt_tokens=4, completion_tokens=2, draft_tokens_proposed=4, draft_tokens_accepted=3,
                  acceptance_rate=0.75, steps=2, degraded_steps={"draft_timeout": 1})
    post.on_side(record(tokenizer.encode(" world"), batch_id=11), now=TIMEOUT)
    [chunk] = chunks(post.on_commit(commit(1, tokenizer.encode(" world"), finish_reason="eos", usage=usage,
                                           **WANTS_LOGPROBS), now=TIMEOUT))
    assert chunk.finish_reason == "eos" and chunk.logprobs is not None
    assert chunk.usage.degraded_steps == {"draft_timeout": 1, "logprobs_timeout": 1}
    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.acceptance_rate) == (4, 2, 0.75)


def test_a_stop_string_in_the_final_commit_leaves_out_the_accepted_drafts_it_cut(post, tokenizer):
    """The scheduler's usage counts every accepted draft of its final commit; where a stop string
    cuts that commit, the accepted drafts after the cut are not in the output, nor in the usage
    (the tallies of a request a stop string ends in an earlier commit count them so too)."""
    tokens = tokenizer.encode("ab STOP cd ef")
    usage = Usage(prompt_tokens=4, completion_tokens=len(tokens), draft_tokens_proposed=len(tokens),
                  draft_tokens_accepted=len(tokens) - 1, acceptance_rate=(len(tokens) - 1) / len(tokens), steps=1)
    [chunk] = chunks(post.on_commit(commit(0, tokens, num_accepted=len(tokens) - 1, finish_reason="length",
                                           usage=usage, stop=["STOP"]), now=0.0))
    assert chunk.finish_reason == "stop" and len(chunk.token_ids) < len(tokens)
    assert chunk.usage.draft_tokens_accepted == sum(chunk.from_draft) == len(chunk.token_ids)
    assert chunk.usage.acceptance_rate == len(chunk.token_ids) / len(tokens)
    assert chunk.usage.completion_tokens == len(chunk.token_ids)


def test_stream_false_publishes_one_final_chunk_with_everything(post, tokenizer):
    pieces = [tokenizer.encode("hello"), tokenizer.encode(" world")]
    options = dict(stream=False, expect_side_channel=True, logprobs=LogprobOptions(logprobs=1))
    for seq, piece in enumerate(pieces):
        post.on_side(record(piece, batch_id=10 + seq), now=0.0)
    assert post.on_commit(commit(0, pieces[0], num_accepted=1, prompt_token_ids=[1, 2], **options), now=0.0) == []
    [chunk] = chunks(post.on_commit(commit(1, pieces[1], finish_reason="length", **options), now=0.0))
    assert chunk.seq == 0 and chunk.text == "hello world" and chunk.finish_reason == "length"
    assert chunk.token_ids.tolist() == pieces[0] + pieces[1]
    assert chunk.from_draft == [True, False] and len(chunk.logprobs) == 2
    assert chunk.prompt_token_ids.tolist() == [1, 2] and chunk.usage.completion_tokens == 2


def test_client_gone_ends_the_request_and_notifies_the_scheduler(post, tokenizer):
    post.on_commit(commit(0, tokenizer.encode("hello")), now=0.0)
    [notice] = notices(post.client_gone("r1", now=0.1))
    assert notice.reason == "error" and notice.num_tokens == 1
    assert post.client_gone("r1", now=0.2) == []  # every bounced chunk reports it; acted on once
    assert post.on_commit(commit(1, tokenizer.encode("abc")), now=0.3) == []
    assert post.counters.clients_gone == 1 and post.counters.ignored_commits == 1 and post.load == 0


def test_requests_over_the_limit_are_refused_with_overloaded(tokenizer):
    post = Postprocessor(tokenizer, "post-a", max_requests=1)
    post.on_commit(commit(0, [5]), now=0.0)
    outs = post.on_commit(commit(0, [5], request_id="r2"), now=0.0)
    assert chunks(outs)[0].error.code == "overloaded" and notices(outs)[0].reason == "error"
    assert post.counters.refused_requests == 1 and post.load == 1


def test_a_request_id_reused_by_another_scheduler_is_served_or_refused_never_dropped(post, tokenizer):
    """Commits of a reused id are never dropped for finished_ttl_s (the client would wait out its
    timeout). Ids are unique per scheduler: another scheduler's new request with the id of a
    finished one is a new stream; with the id of a running one it is refused, typed."""
    post.on_commit(commit(0, tokenizer.encode("hello"), finish_reason="length"), now=0.0)
    other = commit(0, tokenizer.encode("abc"), client_inbox="_INBOX.other").model_copy(update={"scheduler_id": "sched-2"})
    [chunk] = chunks(post.on_commit(other, now=1.0))
    assert chunk.seq == 0 and chunk.error is None and tokenizer.decode(chunk.token_ids.tolist()) == "abc"
    third = other.model_copy(update={"scheduler_id": "sched-3", "client_inbox": "_INBOX.third"})
    outs = post.on_commit(third, now=2.0)
    [refused] = chunks(outs)
    assert refused.finish_reason == "error" and refused.error.code == "duplicate_request_id"
    assert [out.inbox for out in outs if isinstance(out, ChunkToClient)] == ["_INBOX.third"]
    [notice] = [out for out in outs if isinstance(out, NoticeToScheduler)]
    assert notice.scheduler_id == "sched-3" and notice.notice.reason == "error"
    assert post.requests["r1"].scheduler_id == "sched-2" and post.counters.duplicate_requests == 1


# ---------------------------------------------------------------------------------------------
# the service over a real nats-server


@contextlib.asynccontextmanager
async def running_postprocessor(url, tokenizer_dir, instance_id="post-a"):
    config = load_config(PostprocessorConfig, env={}, nats_url=url, tokenizer=str(tokenizer_dir),
                         instance_id=instance_id, side_channel_timeout_s=0.3, heartbeat_interval_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(run_postprocessor(config, stop))
    try:
        yield config
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


@pytest.fixture
async def postprocessor(nats_server, tokenizer_dir):
    async with running_postprocessor(nats_server.url, tokenizer_dir) as config:
        yield config


async def scheduler_side(nc, subjects_prefix="specbus"):
    """The test plays the scheduler: GenerateRequests (with their reply inbox) and StopNotices land in queues."""
    requests, stop_notices = asyncio.Queue(), asyncio.Queue()
    await nc.subscribe(f"{subjects_prefix}.generate.client", cb=requests.put)
    await nc.subscribe(f"{subjects_prefix}.stop.sched-1", cb=stop_notices.put)
    await nc.flush(timeout=2)
    return requests, stop_notices


async def wait_heartbeat(nc, instance_id="post-a"):
    """The first heartbeat of instance_id: it beats once its subscriptions are in place."""
    sub = await nc.subscribe("specbus.heartbeat")
    try:
        while True:
            beat = decode((await sub.next_msg(timeout=5)).data, Heartbeat)
            if beat.instance_id == instance_id:
                return beat
    finally:
        await sub.unsubscribe()


async def test_service_streams_joined_chunks_to_the_client(nats_server, nc, postprocessor, tokenizer):
    beat = await wait_heartbeat(nc)
    assert beat.role == "postprocessor" and beat.instance_id == "post-a" and len(beat.model_ids["tokenizer"]) == 16
    requests, _ = await scheduler_side(nc)
    ids = tokenizer.encode("hello world abc")
    async with Client(nats_server.url) as client:
        generation = asyncio.create_task(client.generate(make_request([1, 2, 3], logprobs=1, timeout_s=10)))
        msg = await asyncio.wait_for(requests.get(), timeout=5)
        sent = decode(msg.data, GenerateRequest)
        options = dict(client_inbox=msg.reply, request_id=sent.request_id, logprobs=sent.logprobs,
                       expect_side_channel=True)
        # out of order, the record of the last step first, one record withheld (step 1)
        await nc.publish("specbus.post.post-a.side", encode(record(ids[2:], request_id=sent.request_id, batch_id=12)))
        await nc.publish("specbus.post.post-a.commit", encode(commit(1, ids[1:2], **options)))
        await nc.publish("specbus.post.post-a.commit", encode(commit(0, ids[:1], prompt_token_ids=[1, 2, 3],
                                                                     **options)))
        await nc.publish("specbus.post.post-a.side", encode(record(ids[:1], request_id=sent.request_id, batch_id=10)))
        await nc.publish("specbus.post.post-a.commit", encode(commit(2, ids[2:], finish_reason="length",
                                                                     usage=Usage(steps=3), **options)))
        result = await asyncio.wait_for(generation, timeout=10)
    assert result.text == "hello world abc" and result.token_ids == ids and result.finish_reason == "length"
    assert result.prompt_token_ids == [1, 2, 3]
    assert [entry is not None for entry in result.logprobs] == [True, False, True]
    assert result.degraded == ["logprobs_timeout"]
    assert result.usage.degraded_steps == {"logprobs_timeout": 1}


async def test_request_moves_to_another_postprocessor_without_gap_or_repeat(nats_server, nc, tokenizer_dir,
                                                                             tokenizer):
    requests, _ = await scheduler_side(nc)
    ids = tokenizer.encode("hello world abc é€ xyz the end")
    pieces = [ids[0:2], ids[2:4], ids[4:7], ids[7:9], ids[9:]]
    async with running_postprocessor(nats_server.url, tokenizer_dir, "post-b"), Client(nats_server.url) as client:
        async with running_postprocessor(nats_server.url, tokenizer_dir, "post-a"):
            await wait_heartbeat(nc, "post-a")
            await wait_heartbeat(nc, "post-b")
            stream = await client.open_stream(make_request([1, 2], stop=["zzz"], timeout_s=10))
            msg = await asyncio.wait_for(requests.get(), timeout=5)
            request_id = decode(msg.data, GenerateRequest).request_id
            commits = [commit(seq, piece, request_id=request_id, client_inbox=msg.reply, stop=["zzz"],
                              finish_reason="length" if seq == len(pieces) - 1 else None)
                       for seq, piece in enumerate(pieces)]
            for item in commits[:3]:
                await nc.publish("specbus.post.post-a.commit", encode(item))
            received = [await asyncio.wait_for(anext(stream), timeout=5) for _ in range(3)]
        # post-a is gone; the scheduler replays its last commits to post-b, the first with the
        # completion before it, so the client sees seqs 1 and 2 again and drops them
        replays = [commits[1].model_copy(update={"resume_token_ids": np.array(pieces[0], np.int32)}), *commits[2:]]
        for item in replays:
            await nc.publish("specbus.post.post-b.commit", encode(item))
        received += [item async for item in stream]
        await stream.close()
    assert [item.seq for item in received] == [0, 1, 2, 3, 4]
    assert "".join(item.text for item in received) == tokenizer.decode(ids)
    assert stream.num_duplicates == 2


async def test_service_counts_bad_messages_and_keeps_serving(nats_server, nc, postprocessor):
    await wait_heartbeat(nc)
    for payload in (b"\x00garbage", encode(StopNotice(request_id="x", batch_id=0, step=0, postprocessor_id="p"))):
        await nc.publish("specbus.post.post-a.commit", payload)
        await nc.publish("specbus.post.post-a.side", payload)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("specbus.post.post-a.commit", encode(commit(0, [5], client_inbox=inbox, finish_reason="length")),
                     reply="")
    chunk_msg = await sub.next_msg(timeout=5)
    assert chunk_msg.data  # still serving
    for _ in range(50):  # the side subscription runs on its own; give it a moment under load
        stats = json.loads((await request(nc, "$SRV.STATS.postprocessor", b"", timeout_s=5)).data)
        data = {endpoint["name"]: endpoint["data"] for endpoint in stats["endpoints"]}
        if data["commit"]["bad_messages"] >= 4:
            break
        await asyncio.sleep(0.1)
    assert data["commit"]["bad_messages"] == 4
    ping = json.loads((await request(nc, "$SRV.PING.postprocessor", b"", timeout_s=5)).data)
    assert ping["name"] == "postprocessor"


async def test_service_tells_the_scheduler_when_the_client_is_gone(nats_server, nc, postprocessor, tokenizer):
    await wait_heartbeat(nc)
    _, stop_notices = await scheduler_side(nc)
    started = time.monotonic()
    await nc.publish("specbus.post.post-a.commit", encode(commit(0, tokenizer.encode("hello"),
                                                                 client_inbox="_INBOX.nobody.listens")))
    notice = decode((await asyncio.wait_for(stop_notices.get(), timeout=5)).data, StopNotice)
    assert notice.reason == "error" and notice.request_id == "r1" and notice.postprocessor_id == "post-a"
    assert time.monotonic() - started < 3  # the bounce is immediate, not a timeout


async def test_service_stops_cleanly_when_asked(nats_server, tokenizer_dir):
    config = load_config(PostprocessorConfig, env={}, nats_url=nats_server.url, tokenizer=str(tokenizer_dir),
                         instance_id="post-b")
    stop = asyncio.Event()
    task = asyncio.create_task(run_postprocessor(config, stop))
    nc = await connect(nats_server.url, "probe")
    try:
        for _ in range(100):
            try:
                await request(nc, "$SRV.PING.postprocessor", b"", timeout_s=0.2)
                break
            except Exception:
                await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        with pytest.raises(BusNoResponders, match="no responders"):
            await request(nc, "$SRV.PING.postprocessor", b"", timeout_s=0.5)
    finally:
        await nc.close()
