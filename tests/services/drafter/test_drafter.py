"""The drafter: tiny random real Llama checkpoints with a d2t map (many-to-one entry, "other"
id), checked against plain full forwards of the same model in transformers; and the service
over a real nats-server."""

import asyncio
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from gpu_worker.runtime.checkpoint import save_d2t
from gpu_worker.drafter.drafter_core import draft_batch, load_drafter
from gpu_worker.runtime.kv_cache import KEY_BLOCK
from gpu_worker.sampling.rejection import proposal_to_draft_probs
from gpu_worker.sampling.sampler import SamplingTensors, process_logits
from schemas.bus.clock import MAX_CLOCK_SKEW_S
from schemas.bus.codec import decode, encode
from schemas.config import DrafterConfig, load_config
from schemas.bus.control import Heartbeat
from schemas.errors import ErrorCode, SpecbusError
from schemas.generation import RowSampling
from schemas.steps import DraftRequest, DraftResponse, DraftRow
from schemas.bus.subjects import Subjects
from schemas.bus.wire import Error
from services.drafter.drafter import run_drafter
from services.runtime.bus import request
from tests.tiny_checkpoints import TINY, write_hf_model

VD = TINY["vocab_size"]  # draft vocabulary
VT = 128  # target vocabulary
PROMPT = [5, 17, 42, 8, 99, 23, 61, 3, 77, 12, 50, 31, 6]  # target ids
MAX_SLOTS = 4


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A draft checkpoint whose "other" id is the model's own greedy choice after PROMPT, so
    a drafter that failed to mask it would propose it. d2t: draft id i -> perm[i], except `dup`,
    which maps to the same target id as dup + 1 (many-to-one). Target ids outside the draft
    vocabulary (and perm[dup]) map to other on input."""
    path = tmp_path_factory.mktemp("draft")
    hf = write_hf_model(path, "llama", seed=3)
    perm = torch.randperm(VT, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the prompt read with the identity map of perm; other_id is decided from it
        first_guess = torch.argsort(perm)[torch.tensor(PROMPT)] % VD
        other_id = int(hf(first_guess[None]).logits[0, -1].argmax())
    dup = (other_id + 1) % VD
    d2t = perm[:VD].clone()
    d2t[dup] = perm[(dup + 1) % VD]
    t2d = torch.full((VT,), other_id, dtype=torch.int64)
    for i in range(VD):
        if i not in (other_id, dup):
            t2d[perm[i]] = i
    save_d2t(path, d2t, t2d, other_id)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VT)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return SimpleNamespace(path=path, hf=hf, d2t=d2t, t2d=t2d, other_id=other_id)


def new_drafter(draft, **overrides):
    settings = dict(draft_model=str(draft.path), instance_id="drafter-test", max_slots=MAX_SLOTS, max_seq_len=64,
                    dtype="float32")
    return load_drafter(load_config(DrafterConfig, env={}, **{**settings, **overrides}))


def draft_request(*rows, release=(), batch_id=1, deadline_s=30.0):
    return DraftRequest(batch_id=batch_id, scheduler_id="sched-test", deadline=time.time() + deadline_s,
                        rows=list(rows), release=list(release))


def row(request_id, new_token_ids, num_draft=4, cached_len=0, mode="greedy", index=0, **sampling):
    sampling.setdefault("coupling", "rejection")  # draft_mode's rows; a Gumbel-coupled one drafts by its noise
    return DraftRow(request_id=request_id, row=index, step=0, cached_len=cached_len, new_token_ids=new_token_ids,
                    num_draft=num_draft, draft_mode=mode, sampling=RowSampling(**sampling))


def results(drafter, *rows, **kwargs):
    """request_id -> DraftResult of one draft_batch."""
    return {r.request_id: r for r in draft_batch(drafter, draft_request(*rows, **kwargs)).rows}


def draft_logits(draft, draft_ids):
    """Logits [V_draft] after draft_ids from a plain full forward in transformers, other masked."""
    with torch.no_grad():
        logits = draft.hf(torch.tensor([draft_ids])).logits[0, -1].clone()
    logits[draft.other_id] = float("-inf")
    return logits


def greedy_continuation(draft, history, k):
    """The draft model's own greedy continuation of `history` (target ids), as target ids."""
    ids = draft.t2d[torch.tensor(history)].tolist()
    for _ in range(k):
        ids.append(int(draft_logits(draft, ids).argmax()))
    return draft.d2t[torch.tensor(ids[len(history):])].tolist()


def same_result(a, b):
    assert a.draft_token_ids.tolist() == b.draft_token_ids.tolist()
    assert a.proposal.kind == b.proposal.kind and a.need_resync == b.need_resync
    if a.proposal.kind == "sparse":
        assert np.array_equal(a.proposal.ids, b.proposal.ids)
        np.testing.assert_allclose(a.proposal.probs, b.proposal.probs, atol=1e-6)


# --- greedy ----------------------------------------------------------------------------------


def test_a_drafters_auto_dtype_is_bfloat16_and_a_given_one_wins(draft):
    auto = new_drafter(draft, dtype="auto")
    assert auto.model.embed.dtype == auto.cache.dtype == torch.bfloat16
    assert new_drafter(draft, dtype="float32").model.embed.dtype == torch.float32


def test_greedy_drafts_are_the_draft_models_own_continuation_in_target_ids(draft):
    drafter = new_drafter(draft)
    with torch.no_grad():
        unmasked = draft.hf(draft.t2d[torch.tensor([PROMPT])]).logits[0, -1].argmax()
    assert int(unmasked) == draft.other_id  # the fixture made "other" the model's favourite
    got = results(drafter, row("a", PROMPT, num_draft=5))["a"]
    assert got.proposal.kind == "point_mass" and not got.need_resync
    assert got.draft_token_ids.tolist() == greedy_continuation(draft, PROMPT, 5)
    assert int(draft.d2t[draft.other_id]) not in got.draft_token_ids.tolist()


def test_sample_mode_at_temperature_zero_is_greedy(draft):
    drafter = new_drafter(draft)
    got = results(drafter, row("a", PROMPT, num_draft=3, mode="sample", temperature=0.0, seed=1))["a"]
    assert got.proposal.kind == "point_mass"
    assert got.draft_token_ids.tolist() == greedy_continuation(draft, PROMPT, 3)


# --- sampled ---------------------------------------------------------------------------------


SAMPLED = dict(mode="sample", temperature=1.3, top_k=40, top_p=0.95, seed=1234)


def test_sampled_drafts_depend_only_on_the_seed(draft):
    drafter = new_drafter(draft)
    first = results(drafter, row("a", PROMPT, **SAMPLED))["a"]
    again = results(new_drafter(draft), row("b", PROMPT, **SAMPLED))["b"]
    same_result(first, again)
    others = [results(drafter, row(f"s{seed}", PROMPT, **{**SAMPLED, "seed": seed}))[f"s{seed}"]
              for seed in (1, 2, 3)]
    assert any(o.draft_token_ids.tolist() != first.draft_token_ids.tolist() for o in others)


def test_sparse_proposal_is_the_distribution_the_drafts_were_drawn_from(draft):
    drafter = new_drafter(draft)
    k = 4
    got = results(drafter, row("a", PROMPT, num_draft=k, **{**SAMPLED, "min_p": 0.02}))["a"]
    drafts, proposal = got.draft_token_ids, got.proposal
    assert proposal.kind == "sparse" and len(drafts) == k
    np.testing.assert_allclose(proposal.probs.sum(1), 1.0, atol=1e-5)
    for j in range(k):
        assert proposal.probs[j][proposal.ids[j] == drafts[j]].item() > 0
        assert int(draft.d2t[draft.other_id]) not in proposal.ids[j].tolist()
    # the draft ids the drafter fed after the history; they must map to the drafts it sent
    fed = drafter.requests[("sched-test", "a")].token_ids
    assert draft.d2t[torch.tensor(fed[len(PROMPT):])].tolist() == drafts[:k - 1].tolist()
    params = SamplingTensors.build([1.3], [40], [0.95], [0.02])
    sent = proposal_to_draft_probs("sparse", torch.from_numpy(drafts).long()[None], VT,
                                   sparse_ids=torch.from_numpy(proposal.ids).long()[None],
                                   sparse_probs=torch.from_numpy(proposal.probs)[None])[0]
    for j in range(k):
        probs = process_logits(draft_logits(draft, fed[:len(PROMPT) + j]).view(1, 1, -1), params).probs[0, 0]
        expected = torch.zeros(VT).index_add_(0, draft.d2t, probs)  # many-to-one ids add up
        torch.testing.assert_close(sent[j], expected, atol=1e-5, rtol=0)


# --- state: resync, truncate, reuse, batching, release ---------------------------------------


def test_unknown_request_or_short_slot_needs_resync(draft):
    drafter = new_drafter(draft)
    got = results(drafter, row("a", PROMPT[5:], cached_len=5))["a"]
    assert got.need_resync and len(got.draft_token_ids) == 0
    assert drafter.cache.num_free == MAX_SLOTS  # nothing allocated
    results(drafter, row("b", PROMPT[:6]))
    behind = results(drafter, row("b", PROMPT[8:], cached_len=8))["b"]  # the drafter holds 6 < 8
    assert behind.need_resync and len(behind.draft_token_ids) == 0


def test_truncate_then_append_equals_a_fresh_request(draft):
    # sampled: the proposal probabilities show any stale context (a random tiny model's argmax
    # barely depends on it)
    drafter = new_drafter(draft)
    results(drafter, row("a", PROMPT, **SAMPLED))
    changed = [7, 7, 90, 1]  # the slot held PROMPT[6:]; the scheduler's history says otherwise
    got = results(drafter, row("a", changed, cached_len=6, **SAMPLED))["a"]
    fresh = results(new_drafter(draft), row("a", PROMPT[:6] + changed, **SAMPLED))["a"]
    same_result(got, fresh)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_accepted_drafts_are_not_recomputed(draft, mode):
    drafter = new_drafter(draft)
    params = SAMPLED if mode == "sample" else {}
    first = results(drafter, row("a", PROMPT, **params))["a"].draft_token_ids.tolist()
    # the verifier accepted two drafts and emitted token 9: history grows by 3
    new = first[:2] + [9]
    reused_before = drafter.counters["reused_tokens"]
    got = results(drafter, row("a", new, cached_len=len(PROMPT), **params))["a"]
    reused = drafter.counters["reused_tokens"] - reused_before
    fresh = results(new_drafter(draft), row("a", PROMPT + new, **params))["a"]
    same_result(got, fresh)
    assert reused == 2


def test_a_row_drafts_the_same_alone_and_in_a_batch(draft):
    rows = [
        row("g", PROMPT, num_draft=4, index=0),
        row("s", PROMPT[:7], num_draft=3, index=1, **SAMPLED),
        row("long", (PROMPT * 4)[:45], num_draft=2, index=2, mode="sample", temperature=0.8, seed=5),
        row("k0", PROMPT[:4], num_draft=0, index=3),
    ]
    batched = results(new_drafter(draft, max_slots=4), *rows)
    for one in rows:
        drafter = new_drafter(draft)
        drafter.prefill_chunk = 8  # the long row alone is prefilled in chunks
        same_result(results(drafter, one)[one.request_id], batched[one.request_id])
    assert len(batched["k0"].draft_token_ids) == 0


def test_release_frees_slots_and_forgets_the_request(draft):
    drafter = new_drafter(draft)
    results(drafter, row("a", PROMPT, index=0), row("b", PROMPT[:5], index=1))
    assert drafter.cache.num_free == MAX_SLOTS - 2
    response = draft_batch(drafter, draft_request(release=["a", "b", "never-seen"]))
    assert response.rows == [] and drafter.cache.num_free == MAX_SLOTS
    assert results(drafter, row("a", [1], cached_len=len(PROMPT)))["a"].need_resync


def test_idle_slots_are_freed_and_a_full_cache_evicts_the_least_recently_used(draft):
    drafter = new_drafter(draft, slot_idle_ttl_s=60.0)
    now = time.monotonic()
    for i in range(MAX_SLOTS):
        draft_batch(drafter, draft_request(row(f"r{i}", PROMPT[:5])), now=now + i)
    got = draft_batch(drafter, draft_request(row("new", PROMPT[:5])), now=now + 10).rows[0]
    assert len(got.draft_token_ids) == 4 and ("sched-test", "r0") not in drafter.requests  # r0 was used least recently
    draft_batch(drafter, draft_request(), now=now + 62.5)
    assert sorted(rid for _, rid in drafter.requests) == ["new", "r3"]  # r1 (t+1) and r2 (t+2) idle for more than 60 s


def test_short_kv_memory_gives_no_drafts_and_holds_nothing(draft):
    # room for one slot: max_seq_len 64 rounded up to a whole key block (256) + a scratch column,
    # 257 positions x 256 bytes = 65,792; two would need 131,584
    drafter = new_drafter(draft, kv_cache_memory="100000")
    got = results(drafter, row("a", PROMPT, index=0), row("b", PROMPT, index=1))
    assert len(got["a"].draft_token_ids) == 4 and len(got["b"].draft_token_ids) == 0 and not got["b"].need_resync
    assert sorted(rid for _, rid in drafter.requests) == ["a"] and drafter.counters["slots_memory"] == 1
    assert drafter.cache.nbytes == (KEY_BLOCK + 1) * 256 == drafter.cache.slot_bytes(1)


def test_bad_token_id_is_refused_by_field_and_changes_nothing(draft):
    drafter = new_drafter(draft)
    results(drafter, row("a", PROMPT))
    with pytest.raises(SpecbusError, match="outside the vocabulary") as raised:
        draft_batch(drafter, draft_request(row("b", PROMPT, index=0), row("c", [3, VT], index=1), release=["a"]))
    assert raised.value.field == "rows[1].new_token_ids"
    assert sorted(rid for _, rid in drafter.requests) == ["a"] and drafter.cache.num_free == MAX_SLOTS - 1


# --- over NATS ---------------------------------------------------------------------------------


async def test_run_drafter_serves_draft_requests_over_nats(nats_server, nc, draft):
    config = load_config(DrafterConfig, env={}, nats_url=nats_server.url, draft_model=str(draft.path),
                         instance_id="drafter-nats", max_slots=MAX_SLOTS, max_seq_len=64, heartbeat_interval_s=0.05,
                         dtype="float32")
    subjects = Subjects()
    beats: asyncio.Queue = asyncio.Queue()

    async def on_beat(msg):
        await beats.put(decode(msg.data, Heartbeat))

    await nc.subscribe(subjects.heartbeat, cb=on_beat)
    stop = asyncio.Event()
    task = asyncio.create_task(run_drafter(config, stop))
    beat = await asyncio.wait_for(beats.get(), timeout=30)
    assert beat.role == "drafter" and beat.instance_id == "drafter-nats" and beat.free_slots == MAX_SLOTS
    assert set(beat.model_ids) == {"draft", "tokenizer", "target_vocab_size"}
    assert beat.model_ids["target_vocab_size"] == str(VT)

    subject = subjects.draft("drafter-nats")
    sent = draft_request(row("a", PROMPT, num_draft=3), batch_id=7)
    response = decode((await request(nc, subject, encode(sent), timeout_s=10)).data, DraftResponse)
    assert response.batch_id == 7 and response.drafter_id == "drafter-nats"
    assert response.rows[0].draft_token_ids.tolist() == greedy_continuation(draft, PROMPT, 3)

    malformed = decode((await request(nc, subject, b"\xc1 not msgpack", timeout_s=10)).data, Error)
    assert malformed.code == ErrorCode.malformed
    bad_row = draft_request(row("b", [1, VT + 5]))
    bad = decode((await request(nc, subject, encode(bad_row), timeout_s=10)).data, Error)
    assert bad.code == ErrorCode.invalid_field and bad.field == "rows[0].new_token_ids"
    expired = draft_request(row("c", PROMPT), deadline_s=-(MAX_CLOCK_SKEW_S + 1.0))  # past even a skewed clock's allowance
    late = decode((await request(nc, subject, encode(expired), timeout_s=10)).data, Error)
    assert late.code == ErrorCode.timeout and late.field == "deadline"

    ping = json.loads((await request(nc, "$SRV.PING.drafter", b"", timeout_s=10)).data)
    assert ping["name"] == "drafter"
    while (beat := await asyncio.wait_for(beats.get(), timeout=10)).free_slots != MAX_SLOTS - 1:
        pass
    stop.set()
    await asyncio.wait_for(task, timeout=15)


# --- limits ----------------------------------------------------------------------------


def test_drafts_stop_where_the_verifier_would_refuse_the_row(draft):
    """Item 4: the drafter offered one draft more than the verifier holds (history + drafts <= max_seq_len)."""
    drafter = new_drafter(draft, max_seq_len=64)
    history = (PROMPT * 5)[:62]
    got = results(drafter, row("a", history, num_draft=4))["a"]
    assert len(got.draft_token_ids) == 2 and not got.need_resync
    full = results(drafter, row("b", (PROMPT * 5)[:64], num_draft=4))["b"]
    assert len(full.draft_token_ids) == 0 and not full.need_resync


def test_a_sampled_proposal_is_bounded_and_is_the_truncated_law_it_was_drawn_from(draft, monkeypatch):
    """Item 5: a sampled draft's proposal covered the whole vocabulary (~1 MiB a row at 32k).
    The drafter samples from its top MAX_DRAFT_SUPPORT ids, renormalised, and sends exactly that."""
    monkeypatch.setattr("gpu_worker.drafter.drafter_core.MAX_DRAFT_SUPPORT", 8)
    drafter = new_drafter(draft)
    k = 3
    got = results(drafter, row("a", PROMPT, num_draft=k, mode="sample", temperature=1.0, seed=5))["a"]
    proposal, drafts = got.proposal, got.draft_token_ids
    assert proposal.kind == "sparse" and proposal.ids.shape[1] <= 8 and len(drafts) == k
    np.testing.assert_allclose(proposal.probs.sum(1), 1.0, atol=1e-5)
    fed = drafter.requests[("sched-test", "a")].token_ids
    sent = proposal_to_draft_probs("sparse", torch.from_numpy(drafts).long()[None], VT,
                                   sparse_ids=torch.from_numpy(proposal.ids).long()[None],
                                   sparse_probs=torch.from_numpy(proposal.probs)[None])[0]
    params = SamplingTensors.build([1.0], [8])
    for j in range(k):
        probs = process_logits(draft_logits(draft, fed[:len(PROMPT) + j]).view(1, 1, -1), params).probs[0, 0]
        torch.testing.assert_close(sent[j], torch.zeros(VT).index_add_(0, draft.d2t, probs), atol=1e-5, rtol=0)
