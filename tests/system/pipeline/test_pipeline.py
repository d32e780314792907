"""End to end: every service a separate process (services.launch.stack.Stack), a
real nats-server, the shipped model pair.

The models in models/ are being retrained and overwritten by checkpoints, so every stack here
loads the session's copy (the `tiny_pair` fixture): all processes see the same weights, and no
assertion depends on how good they are (greedy equality holds for any weights).

Two stacks: `stack` is shared by the tests that disturb nothing; `fault_stack` is small (a
scheduler admitting 2 running + 2 queued requests) and restricted (its verifier's NATS user may
not publish side-channel records, so they are really withheld). A drafter kill, greedy and
Gumbel-coupled samples alike, is tests/system/faults/test_faults.py's fault matrix (float32) and
tests/system/faults/test_cluster.py (bfloat16).
"""

import asyncio
import json
import math
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import pytest_asyncio

from ops.train.train_models import read_text, source_files
from schemas.bus.codec import decode
from schemas.errors import ErrorCode
from schemas.generation import GenerateRequest
from schemas.streams import StreamChunk
from services.client import Client, Overloaded, RequestError, make_request, score_request
from services.launch.natsserver import NatsServerConfig
from services.runtime.auth import NatsUser
from services.runtime.bus import connect

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 24
PROMPT_TOKENS = 24
NUM_PROMPTS = 16
TIMEOUT_S = 120.0


def specbus(*args):
    return [sys.executable, "-m", "services.cli", *args]


def held_out_prompts(tokenizer) -> list[list[int]]:
    """PROMPT_TOKENS tokens from the middle of each of the first held-out stdlib files (NUM_PROMPTS)."""
    _, held_out = source_files()
    found = []
    for path in held_out:
        ids = tokenizer.encode(read_text(path))
        window = ids[len(ids) // 2:len(ids) // 2 + PROMPT_TOKENS]
        if len(window) == PROMPT_TOKENS and window not in found:
            found.append(window)
        if len(found) == NUM_PROMPTS:
            return found
    raise AssertionError(f"only {len(found)} held-out files give a {PROMPT_TOKENS}-token prompt")


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return held_out_prompts(tokenizer)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["float32", "bfloat16"])
async def stack(start_stack, tiny_pair, request):
    """The shared stack, once per dtype: every identity below is bitwise in both (bf16 is what a
    GPU and `auto` on a CPU with native bf16 run; on a CPU without it bf16 is emulated, slower)."""
    # A generous draft timeout: on a loaded 2-core machine a late drafter would make steps run
    # with k=0, and a sampled request's tokens depend on the drafts it was offered (the rejection
    # sampler keeps the distribution, not the draw), so the equality tests below would not hold.
    # Adaptive k off: these tests run each k they name (k=2 runs 2 drafts a step), and the CLI
    # test compares which tokens came from drafts across two runs, which adaptive k decides from
    # timings (its own tests: tests/system/pipeline/test_adaptive_k_stack.py).
    scheduler = ["--max-tokens-cap", "256", "--draft-timeout-s", "5", "--adaptive-k", "false"]
    async with start_stack(*tiny_pair, dtype=request.param, role_args={"scheduler": scheduler}) as running:
        yield running


def greedy(prompt, k, max_tokens=MAX_TOKENS, **options):
    return make_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=k,
                        timeout_s=TIMEOUT_S, **options)


def sampled(prompt, seed, k=4, max_tokens=MAX_TOKENS, **options):
    return make_request(prompt, max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True,
                        num_speculative_tokens=k, draft_mode="sample", timeout_s=TIMEOUT_S, **options)


async def generate_all(client, requests):
    return await asyncio.gather(*(client.generate(request) for request in requests))


# ---------------------------------------------------------------------------------------------
# the shared stack


async def test_greedy_speculative_decoding_equals_plain_greedy(stack, client, prompts):
    """In the stack's dtype (the verifier says which it loaded), for every k: drafts were proposed,
    and at k=4 some accepted, so the verify steps took part in the output."""
    outputs = {}
    for k in (0, 1, 2, 4, 8):
        results = await generate_all(client, [greedy(prompt, k) for prompt in prompts[:10]])
        assert [r.finish_reason for r in results] == ["length"] * 10
        outputs[k] = [r.token_ids for r in results]
        proposed = sum(r.usage.draft_tokens_proposed for r in results)
        assert proposed > 0 if k else proposed == 0
        if k == 4:
            assert sum(r.usage.draft_tokens_accepted for r in results) > 0
    for k in (1, 2, 4, 8):
        for index, (plain, speculative) in enumerate(zip(outputs[0], outputs[k])):
            assert speculative == plain, f"k={k}, prompt {index}"
    assert f"dtype={stack.config.dtype}" in (Path(stack.config.log_dir) / "verifier-0.log").read_text()


async def test_seeded_sampling_is_the_same_twice_and_among_concurrent_requests(client, prompts):
    alone = await client.generate(sampled(prompts[0], seed=7))
    again = await client.generate(sampled(prompts[0], seed=7))
    assert again.token_ids == alone.token_ids and len(alone.token_ids) == MAX_TOKENS, again.degraded
    crowd = await generate_all(client, [sampled(prompts[0], seed=7), sampled(prompts[0], seed=8),
                                        *(sampled(prompt, seed=100 + i) for i, prompt in enumerate(prompts[1:7]))])
    assert crowd[0].token_ids == alone.token_ids, crowd[0].degraded
    assert crowd[1].token_ids != alone.token_ids  # the seed matters: the test above can fail


async def test_concurrent_requests_each_get_their_output_alone(stack, client, prompts):
    """Greedy and sampled rows, k from 0 to 8, arriving together: the verifier batches (and
    reorders) them, yet every request gets exactly what it gets alone."""
    requests = [greedy(p, k=i % 9, max_tokens=12) if i % 2 else sampled(p, seed=i, k=i % 5, max_tokens=12)
                for i, p in enumerate(prompts)]
    alone = [await client.generate(request) for request in requests]
    before = await verifier_counters(stack)
    together = await generate_all(client, [r.model_copy(update={"request_id": r.request_id + "-b"}) for r in requests])
    after = await verifier_counters(stack)
    for index, (one, many) in enumerate(zip(alone, together)):
        assert many.token_ids == one.token_ids, f"request {index}, degraded {one.degraded} / {many.degraded}"
    # Rows shared batches. The verifier runs each batch's rows sorted by chunk length (prefill,
    # then k+1 tokens for each k), not in row order (gpu_worker/verifier/verifier_forwards.py pack_chunks); no
    # counter exposes that order, so what is asserted is that batches held many rows.
    assert after["rows"] - before["rows"] > 2 * (after["batches"] - before["batches"])


async def verifier_counters(stack) -> dict:
    """The verifier's counters from `$SRV.STATS.verifier` (nats.micro)."""
    reply = await stack.nc.request("$SRV.STATS.verifier", b"", timeout=5)
    return json.loads(reply.data)["endpoints"][0]["data"]


@pytest.mark.parametrize("mode", ["raw", "processed"])
async def test_logprobs_of_speculative_tokens_equal_a_scoring_pass(client, prompts, mode):
    params = dict(temperature=0.8, top_k=5, top_p=0.9, seed=3, logprobs_mode=mode)
    probe_ids = list(range(8))
    result = await client.generate(make_request(
        prompts[1], max_tokens=MAX_TOKENS, ignore_eos=True, num_speculative_tokens=4, draft_mode="sample",
        logprobs=5, logprob_token_ids=probe_ids, sampling_mask=True, timeout_s=TIMEOUT_S, **params))
    assert result.usage.draft_tokens_proposed > 0 and not result.degraded
    sequence = prompts[1] + result.token_ids
    scored = await client.generate(score_request(sequence, prompt_logprobs=5, logprob_token_ids=probe_ids,
                                                 timeout_s=TIMEOUT_S, **params))
    assert scored.token_ids == [] and scored.prompt_token_ids == sequence
    # Bit for bit: the forward gives a position the same logits in a verify step as in a prefill.
    for position, (decoded, scoring) in enumerate(zip(result.logprobs, scored.prompt_logprobs[len(prompts[1]):],
                                                      strict=True)):
        assert decoded.token_id == scoring.token_id and decoded.logprob == scoring.logprob, position
        assert decoded.top_ids.tolist() == scoring.top_ids.tolist(), position
        assert decoded.top_logprobs.tolist() == scoring.top_logprobs.tolist(), position
        assert decoded.requested_logprobs.tolist() == scoring.requested_logprobs.tolist(), position

    for position, (entry, mask) in enumerate(zip(result.logprobs, result.sampling_masks)):
        in_mask = set(mask.token_ids.tolist())
        assert not mask.all_tokens and 1 <= len(in_mask) <= 5 and entry.token_id in in_mask, position
        if mode == "processed":
            top = dict(entry.top)
            assert in_mask <= set(top), position  # K is within the top-5 (top_k=5)
            mask_logprobs = np.array([top[token_id] for token_id in in_mask])
            assert abs(np.logaddexp.reduce(mask_logprobs)) < 1e-4, position
            outside = [lp for token_id, lp in [*top.items(), *zip(probe_ids, entry.requested_logprobs.tolist())]
                       if token_id not in in_mask]
            assert all(lp == -math.inf for lp in outside), position


async def test_a_request_over_the_schedulers_cap_is_refused_naming_the_field(client, prompts):
    with pytest.raises(RequestError, match="max_tokens 300 is above the cap 256") as refused:
        await client.generate(make_request(prompts[0], max_tokens=300))
    assert (refused.value.code, refused.value.field) == (ErrorCode.invalid_field, "sampling.max_tokens")


async def test_a_malformed_request_gets_an_error_chunk_naming_the_field(stack, prompts):
    raw = GenerateRequest(request_id="bad-top-p", prompt_token_ids=prompts[0]).model_dump()
    raw["sampling"]["top_p"] = 2.0  # what a client without validation could send
    nc = await connect(stack.url, "pytest-raw", **stack.client_login())
    try:
        inbox = nc.new_inbox()
        subscription = await nc.subscribe(inbox)
        subject = stack.subjects.generate_for(stack.client_login()["user"])
        await nc.publish(subject, msgpack.packb(raw, use_bin_type=True), reply=inbox)
        chunk = decode((await subscription.next_msg(timeout=10)).data, StreamChunk)
    finally:
        await nc.close()
    assert chunk.finish_reason == "error" and chunk.error is not None
    assert (chunk.error.code, chunk.error.field) == (ErrorCode.invalid_field, "sampling.top_p")


async def test_cli_generate_prints_the_result_json_and_streams_text(stack, client, prompts):
    request = greedy(prompts[2], k=4, logprobs=1)
    expected = await client.generate(request)
    ids = ",".join(map(str, prompts[2]))
    common = ["generate", "--url", stack.url, "--prompt-ids", ids, "--max-tokens", str(MAX_TOKENS),
              "--temperature", "0", "--ignore-eos", "-k", "4"]
    login = stack.client_login()
    env = {**os.environ, "SPECBUS_NATS_USER": login["user"], "SPECBUS_NATS_PASSWORD": login["password"]}
    done = await run_cli(*common, "--logprobs", "1", "--json", env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for key in ("text", "token_ids", "prompt_token_ids", "logprobs", "prompt_logprobs", "sampling_masks",
                "finish_reason", "usage"):
        assert key in result
    assert result["token_ids"] == expected.token_ids and result["text"] == expected.text
    assert result["prompt_token_ids"] == prompts[2] and result["finish_reason"] == "length"
    assert [entry["token_id"] for entry in result["logprobs"]] == expected.token_ids
    assert result["usage"]["completion_tokens"] == MAX_TOKENS

    streamed = await run_cli(*common, "--color", "always", "--tokenizer", stack.config.target_model, env=env)
    assert streamed.returncode == 0, streamed.stderr
    plain = streamed.stdout.replace("\x1b[32m", "").replace("\x1b[0m", "")
    assert plain == expected.text + "\n"
    assert ("\x1b[32m" in streamed.stdout) == any(expected.from_draft[:-1])


async def run_cli(*args, timeout_s=120, env=None):
    """The CLI in a subprocess, without blocking the event loop the stack's watcher runs on."""
    return await asyncio.to_thread(subprocess.run, specbus(*args), capture_output=True, text=True, timeout=timeout_s,
                                   env=env)


async def test_gumbel_coupled_sampling_is_the_same_at_every_k_and_still_accepts_drafts(client, prompts):
    outputs = {}
    for k in (0, 4, 8):
        results = await generate_all(client, [sampled(prompt, seed=30 + i, k=k, coupling="gumbel")
                                              for i, prompt in enumerate(prompts[:6])])
        outputs[k] = [r.token_ids for r in results]
        if k:  # the draft proposes with the target's noise: some proposals must be accepted
            assert sum(r.usage.draft_tokens_accepted for r in results) > 0
    assert outputs[4] == outputs[0] and outputs[8] == outputs[0]
    rejection = await generate_all(client, [sampled(prompt, seed=30 + i, k=0, coupling="rejection")
                                            for i, prompt in enumerate(prompts[:6])])
    assert [r.token_ids for r in rejection] != outputs[0]  # another coupling, other draws: the test can fail


# ---------------------------------------------------------------------------------------------
# the small, restricted stack whose parts get withheld and killed


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fault_stack(start_stack, tiny_pair):
    password = secrets.token_hex(16)
    users = (
        NatsUser("service", password),
        # May answer requests and heartbeat, but not publish side-channel records.
        NatsUser("verifier", password, publish=("specbus.heartbeat",), allow_responses=True),
    )
    service_env = {"SPECBUS_NATS_USER": "service", "SPECBUS_NATS_PASSWORD": password}
    settings = dict(
        auth=False, nats=NatsServerConfig(users=users), nats_user="service", nats_password=password,
        role_env={"scheduler": service_env, "drafter": service_env, "postprocessor": service_env,
                  "verifier": {"SPECBUS_NATS_USER": "verifier", "SPECBUS_NATS_PASSWORD": password}},
        role_args={"scheduler": ["--max-running", "2", "--max-queue", "2"],
                   "postprocessor": ["--side-channel-timeout-s", "0.3"]},
    )
    async with start_stack(*tiny_pair, **settings) as running:
        async with Client(running.url, user="service", password=password) as fault_client:
            yield running, fault_client


async def test_withheld_side_channel_gives_chunks_flagged_logprobs_timeout(fault_stack, prompts):
    """No chunk waits for its record for good: one that did would hold the stream until the
    request's deadline, which ends it `timeout` (or the client's StreamTimeout), never `length`."""
    _, client = fault_stack
    reference = await client.generate(greedy(prompts[3], k=4))
    result = await client.generate(greedy(prompts[3], k=4, logprobs=0))
    assert result.token_ids == reference.token_ids and result.finish_reason == "length"
    assert result.usage.degraded_steps["logprobs_timeout"] == result.usage.steps  # every chunk, as none came
    assert all(entry is None for entry in result.logprobs or [])


async def test_a_full_queue_refuses_at_once_with_overloaded(fault_stack, prompts):
    """At once: every refusal comes before any admitted request has finished, so none of them
    waited in the queue for room (a refusal after queueing would come once a request ends)."""
    _, client = fault_stack
    ended: list[str] = []  # "refused" / "finished", in the order the requests ended

    async def ended_as(request):
        try:
            result = await client.generate(request)
        except Overloaded as exc:
            ended.append("refused")
            return exc
        ended.append("finished")
        return result

    outcomes = await asyncio.gather(*(ended_as(greedy(p, k=4)) for p in prompts[:8]))
    refused = [outcome for outcome in outcomes if isinstance(outcome, Overloaded)]
    finished = [outcome for outcome in outcomes if not isinstance(outcome, Overloaded)]
    assert len(refused) >= 4 and len(finished) >= 2  # 2 running + 2 queued fit
    assert ended == ["refused"] * len(refused) + ["finished"] * len(finished), ended
    assert all(exc.code == ErrorCode.overloaded for exc in refused)
    assert all(result.finish_reason == "length" for result in finished)


# ---------------------------------------------------------------------------------------------
# the CLI's own stack commands


async def test_up_serves_until_sigint_and_stops_every_process(tiny_pair, tmp_path, prompts):
    process = await asyncio.create_subprocess_exec(
        *specbus("up", "--port", "0", "--http-port", "0", "--log-dir", str(tmp_path), "--target-model", str(tiny_pair[0]),
                 "--draft-model", str(tiny_pair[1])),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        url = (await asyncio.wait_for(process.stdout.readline(), timeout=30)).decode().strip()
        assert url.startswith("nats://127.0.0.1:")
        ready = (await asyncio.wait_for(process.stdout.readline(), timeout=120)).decode()
        assert ready.startswith("ready: 1 scheduler, 1 verifier, 1 drafter, 1 postprocessor on " + url)
        assert "target weights dense" in ready  # the tiny target has no GGUF blocks
        credentials = (await asyncio.wait_for(process.stdout.readline(), timeout=10)).decode()
        login = dict(line.split("=", 1) for line in Path(credentials.split()[1]).read_text().splitlines())
        async with Client(url, user=login["SPECBUS_NATS_USER"], password=login["SPECBUS_NATS_PASSWORD"]) as client:
            result = await client.generate(greedy(prompts[0], k=4))
        assert len(result.token_ids) == MAX_TOKENS
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    logs = sorted(tmp_path.iterdir())
    assert [path.name for path in logs] == ["client.env", "credentials.env", "drafter-0.log", "gateway-0.log",
                                            "jetstream", "postprocessor-0.log", "scheduler-0.log", "verifier-0.log"]
    logs = [path for path in logs if path.suffix == ".log"]
    for path in logs:  # each stopped on SIGTERM by itself, none was SIGKILLed
        assert "serve_stopped" in path.read_text(), path.name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_demo_runs_generations_and_prints_a_summary(tiny_pair, dtype):
    env = {**os.environ, "SPECBUS_TARGET_MODEL": str(tiny_pair[0]), "SPECBUS_DRAFT_MODEL": str(tiny_pair[1])}
    done = await asyncio.to_thread(subprocess.run, specbus("demo", "--max-tokens", "8", "--dtype", dtype),
                                   capture_output=True,
                                   text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.startswith("nats://127.0.0.1:")
    assert "tokens/s" in done.stdout and "acceptance" in done.stdout and "tokens/step" in done.stdout
    assert "greedy k=4 vs k=0: identical on 3/3 prompts" in done.stdout
    assert done.stdout.rstrip().endswith("stopped")


async def test_int8_weights_serve_a_changed_model_with_speculation_still_exact(start_stack, tiny_pair, prompts):
    """--weights int8: the verifier and the drafter hold Q8_0 blocks quantized at load (their logs
    say so), and greedy output is the same at k=0 and k=4 with drafts accepted."""
    scheduler = ["--draft-timeout-s", "5", "--adaptive-k", "false"]
    async with start_stack(*tiny_pair, weights="int8", role_args={"scheduler": scheduler}) as running:
        async with running.client() as client:
            plain = await generate_all(client, [greedy(prompt, 0) for prompt in prompts[:4]])
            speculative = await generate_all(client, [greedy(prompt, 4) for prompt in prompts[:4]])
        logs = [(Path(running.config.log_dir) / f"{name}-0.log").read_text() for name in ("verifier", "drafter")]
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert sum(r.usage.draft_tokens_accepted for r in speculative) > 0
    assert all("weights=int8" in log and "dtype=float32" in log for log in logs)
