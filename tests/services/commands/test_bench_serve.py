"""`specbus bench serve` end to end, as a process, against a real stack (nats-server, every
service and a gateway, each a process) on the tiny model pair with a ChatML template: a
ShareGPT run over the chat endpoint, a rate sweep over completions with its plot, refusals and
a silent server counted as failures. Nothing here depends on how fast the machine is."""

import asyncio
import json
import os
import sys

import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

COMMAND_TIMEOUT_S = 120
# the scheduler admits 2 running + 2 queued requests: 6 sent at once meet `overloaded`
SCHEDULER_ARGS = ["--max-running", "2", "--max-queue", "2"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, chatml_pair):
    async with start_stack(*chatml_pair, gateways=1, role_args={"scheduler": SCHEDULER_ARGS}) as running:
        yield running


async def bench(*args: str) -> tuple[int, str, str]:
    """Run the command as a process; (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    env.pop("OPENAI_BASE_URL", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.commands.bench_serve", "--disable-tqdm", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), COMMAND_TIMEOUT_S)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode, out.decode(), err.decode()


async def test_a_sharegpt_run_completes_every_request_and_writes_vllms_fields(stack, chatml_pair, tmp_path):
    result_file = tmp_path / "result.json"
    code, out, err = await bench("--client-env", str(stack.client_env_path), "--dataset", "sharegpt",
                                 "--num-prompts", "6", "--sharegpt-output-len", "8", "--max-concurrency", "2",
                                 "--tokenizer", str(chatml_pair[0]), "--goodput", "ttft:600000", "tpot:600000",
                                 "--extra-body", '{"num_speculative_tokens": 2}', "--save-detailed",
                                 "--result-file", str(result_file))
    assert code == 0, err
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    # one progress line per request on stderr, as each completes, with its rate and an ETA
    progress = [line for line in err.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [f"[{i}/6" for i in range(1, 7)]
    assert all("8 tokens in" in line and "tokens/s" in line and "ETA" in line for line in progress)
    assert progress[-1].endswith("ETA 0 s")
    data = json.loads(result_file.read_text())
    assert (data["completed"], data["failed"], data["failures"]) == (6, 0, {})
    assert data["total_output_tokens"] == 6 * 8  # ignore_eos: every request runs to max_tokens
    assert data["output_lens"] == [8] * 6 and data["request_goodput"] > 0
    assert data["model_id"] == chatml_pair[0].name and data["base_url"] == stack.openai_base_url
    assert (data["max_concurrency"], data["request_rate"], data["num_prompts"]) == (2, "inf", 6)
    assert data["total_input_tokens"] > sum(data["input_lens"]) - 1  # the server's counts, template included
    assert 0 <= data["draft_acceptance_rate"] <= 1
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert data[f"{stat}_{name}_ms"] > 0
    assert data["p99_e2el_ms"] >= data["median_e2el_ms"] >= data["median_ttft_ms"]
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration"):
        assert data[key] > 0


async def test_a_rate_sweep_runs_each_rate_and_plots_it(stack, chatml_pair, tmp_path):
    result_file = tmp_path / "sweep.json"
    code, out, err = await bench("--base-url", stack.openai_base_url, "--api-key", stack.api_key(),
                                 "--endpoint", "completions", "--dataset", "random", "--random-input-len", "16",
                                 "--random-output-len", "4", "--num-prompts", "4", "--request-rate", "50,inf",
                                 "--tokenizer", str(chatml_pair[0]), "--result-file", str(result_file))
    assert code == 0, err
    entries = json.loads(result_file.read_text())
    assert [e["request_rate"] for e in entries] == [50.0, "inf"]
    assert all(e["completed"] == 4 and e["total_output_tokens"] == 16 for e in entries)
    assert all(e["backend"] == "openai" and e["max_concurrency"] is None for e in entries)
    assert result_file.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "| rate |" in out


async def test_refusals_are_counted_with_their_codes_and_a_bad_key_stops_the_run(stack, chatml_pair, tmp_path):
    result_file = tmp_path / "refused.json"
    common = ("--base-url", stack.openai_base_url, "--dataset", "random", "--random-input-len", "8",
              "--random-output-len", "64", "--tokenizer", str(chatml_pair[0]))
    code, _, err = await bench(*common, "--api-key", stack.api_key(), "--num-prompts", "3",
                               "--extra-body", '{"no_such_field": 1}', "--result-file", str(result_file))
    data = json.loads(result_file.read_text())
    assert code == 1 and (data["completed"], data["failed"]) == (0, 3)
    assert list(data["failures"]) == ["400 invalid_request_error/invalid_field"]

    # 8 at once past 2 running + 2 queued: whatever the split, each one completes or is refused with 429
    code, _, err = await bench(*common, "--api-key", stack.api_key(), "--num-prompts", "8",
                               "--result-file", str(result_file))
    data = json.loads(result_file.read_text())
    assert code == 0, err
    assert data["completed"] + data["failed"] == 8 and data["completed"] >= 1
    assert set(data["failures"]) <= {"429 rate_limit_error/overloaded"}

    code, _, err = await bench(*common, "--api-key", "sk-wrong", "--num-prompts", "1")
    assert code == 2 and "401" in err and "invalid_api_key" in err


async def test_a_silent_server_fails_each_request_at_its_timeout(chatml_pair, tmp_path):
    accepted = []

    async def never_answer(reader, writer):
        accepted.append(writer)  # held open, never answered

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    result_file = tmp_path / "silent.json"
    try:
        code, _, err = await bench("--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--dataset", "random",
                                   "--random-input-len", "8", "--random-output-len", "4", "--num-prompts", "3",
                                   "--request-timeout", "0.5", "--tokenizer", str(chatml_pair[0]),
                                   "--result-file", str(result_file))
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
    data = json.loads(result_file.read_text())
    assert code == 1, err
    assert (data["completed"], data["failed"], data["failures"]) == (0, 3, {"- timeout": 3})
