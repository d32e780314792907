"""The `specbus` CLI as a user runs it: separate processes, real server, real signals.

The full pipeline through the CLI (`up`, `generate`, `demo`) is in tests/system/pipeline/test_pipeline.py.
"""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from text.tokenizer import load_tokenizer
from schemas.bus.codec import decode
from schemas.config import DEFAULT_DRAFT, TINY_TARGET
from schemas.bus.control import Heartbeat
from schemas.errors import SpecbusError
from schemas.streams import StreamChunk
from schemas.bus.subjects import Subjects
from services.cli import build_generate_request, build_parser, serve_config, split_draft_text
from services.launch.natsserver import NatsServerConfig
from services.launch.processes import StackError
from services.launch.stack import Stack, StackConfig
from services.runtime.auth import NatsUser, generate_credentials, password_env
from services.runtime.bus import BusUnavailable, connect


def specbus(*args):
    return [sys.executable, "-m", "services.cli", *args]


@contextlib.asynccontextmanager
async def specbus_process(*args, **options):
    """`specbus <args>` as a child process (options: create_subprocess_exec's), killed on the
    way out if still running."""
    process = await asyncio.create_subprocess_exec(*specbus(*args), **options)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_nats_command_serves_until_sigterm():
    async with specbus_process("--log-json", "nats", "--port", "0", stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE) as process:
        url = (await asyncio.wait_for(process.stdout.readline(), timeout=30)).decode().strip()
        assert url.startswith("nats://127.0.0.1:")
        nc = await connect(url, "pytest", initial_connect_timeout_s=5.0)
        assert nc.is_connected
        await nc.close()
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=30) == 0
        assert b'"event": "nats_server_stopped"' in await process.stderr.read()


def test_up_refuses_a_draft_that_does_not_fit_the_target():
    result = subprocess.run(specbus("up", "--port", "0", "--http-port", "0", "--target-model", str(TINY_TARGET),
                                    "--draft-model", str(DEFAULT_DRAFT)), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "draft_model" in result.stderr and str(DEFAULT_DRAFT) in result.stderr and str(TINY_TARGET) in result.stderr


async def test_nats_auth_takes_its_users_from_the_environment():
    missing = await asyncio.to_thread(subprocess.run, specbus("nats", "--port", "0", "--auth"), capture_output=True,
                                      text=True, timeout=30, env={**os.environ, "SPECBUS_CLIENT_USERS": ""})
    assert missing.returncode == 2 and "(field: SPECBUS_CLIENT_USERS)" in missing.stderr
    credentials = generate_credentials(["alice"])
    async with specbus_process("nats", "--port", "0", "--auth", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               env={**os.environ, **credentials}) as process:
        url = (await asyncio.wait_for(process.stdout.readline(), timeout=30)).decode().strip()
        alice = await connect(url, "pytest", user="alice", password=credentials[password_env("alice")],
                              initial_connect_timeout_s=5.0)
        await alice.close()
        with pytest.raises(BusUnavailable, match="(?i)authorization"):
            await connect(url, "pytest-anonymous", initial_connect_timeout_s=2.0)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=30) == 0


def test_serve_builds_the_role_config_from_flags_then_env(monkeypatch):
    monkeypatch.setenv("SPECBUS_TARGET_MODEL", "/models/from-env")
    monkeypatch.setenv("SPECBUS_MAX_SLOTS", "7")
    args = build_parser().parse_args(["serve", "verifier", "--nats-url", "nats://h:1", "--instance-id", "v-1",
                                      "--device", "cuda", "--max-slots", "3"])
    config = serve_config(args)
    assert (config.nats_url, config.instance_id, config.device) == ("nats://h:1", "v-1", "cuda")
    assert config.max_slots == 3  # the flag beats the environment
    assert config.target_model == "/models/from-env"


def test_serve_takes_the_nats_password_only_from_the_environment(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "scheduler", "--nats-password", "secret"])
    assert "unrecognized arguments: --nats-password" in capsys.readouterr().err


def test_serve_refuses_a_bad_setting_naming_the_field():
    done = subprocess.run(specbus("serve", "scheduler", "--max-queue", "many"), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "error: invalid_field:" in done.stderr and "(field: max_queue)" in done.stderr


def test_generate_request_has_every_flag():
    args = build_parser().parse_args([
        "generate", "--prompt-ids", "5,6,7", "--max-tokens", "9", "--temperature", "0.7", "--top-k", "40",
        "--top-p", "0.9", "--min-p", "0.05", "--seed", "11", "--stop", "\n\n", "--stop", "END",
        "--stop-token-ids", "0,13", "--ignore-eos", "-k", "3", "--draft-mode", "sample", "--logprobs", "2",
        "--logprobs-mode", "processed", "--prompt-logprobs", "1", "--logprob-token-ids", "4,5",
        "--sampling-mask", "--max-mask-size", "64", "--timeout", "12", "--request-id", "cli-1",
        "--presence-penalty", "0.5", "--frequency-penalty", "-0.25", "--repetition-penalty", "1.1",
        "--logit-bias", "13:-100,42:2.5", "--coupling", "rejection",
    ])
    request = build_generate_request(args)
    assert request.request_id == "cli-1" and request.prompt is None
    assert request.prompt_token_ids.tolist() == [5, 6, 7]
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
            sampling.seed, sampling.ignore_eos) == (9, 0.7, 40, 0.9, 0.05, 11, True)
    assert sampling.stop == ["\n\n", "END"] and sampling.stop_token_ids.tolist() == [0, 13]
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty,
            sampling.coupling) == (0.5, -0.25, 1.1, "rejection")
    assert sampling.logit_bias.as_dict() == {13: -100.0, 42: 2.5}
    assert (request.speculative.num_speculative_tokens, request.speculative.draft_mode) == (3, "sample")
    options = request.logprobs
    assert (options.logprobs, options.logprobs_mode, options.prompt_logprobs, options.sampling_mask,
            options.max_mask_size) == (2, "processed", 1, True, 64)
    assert options.logprob_token_ids.tolist() == [4, 5] and request.timeout_s == 12


@pytest.mark.parametrize("flags,expected", [
    (["--json-schema", '{"type": "object"}'], {"json": {"type": "object"}}),
    (["--json-object"], {"json_object": True}),
    (["--regex", "[0-9]+"], {"regex": "[0-9]+"}),
    (["--choice", "yes", "--choice", "no"], {"choice": ["yes", "no"]}),
    (["--grammar", "@GRAMMAR"], {"grammar": 'start: "x"'}),
])
def test_generate_structured_output_flags(flags, expected, tmp_path):
    (tmp_path / "g.lark").write_text('start: "x"')
    flags = [str(tmp_path / "g.lark") if flag == "@GRAMMAR" else flag for flag in flags]
    flags = ["@" + flag if flag.endswith("g.lark") else flag for flag in flags]
    request = build_generate_request(build_parser().parse_args(["generate", "--prompt", "hi", *flags]))
    given = request.sampling.structured_outputs.model_dump(exclude_defaults=True)
    assert given == expected


def test_generate_refuses_a_bad_request_naming_the_field():
    done = subprocess.run(specbus("generate", "--url", "nats://127.0.0.1:1", "--prompt", "x", "--top-p", "2"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("error: invalid_field: ") and done.stderr.rstrip().endswith("(field: sampling.top_p)")


def test_generate_says_when_nats_is_unreachable():
    done = subprocess.run(specbus("generate", "--url", "nats://127.0.0.1:1", "--prompt", "x", "--timeout", "3"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("error: unavailable: cannot connect to NATS at nats://127.0.0.1:1")


def test_draft_tokens_are_split_from_the_rest_of_a_chunk():
    tokenizer = load_tokenizer(TINY_TARGET)
    before = tokenizer.encode("def main(")
    drafts, rest = tokenizer.encode("argv"), tokenizer.encode("):")
    ids = np.array(drafts + rest, dtype=np.int32)
    chunk = StreamChunk(request_id="r", seq=1, token_ids=ids, text="argv):",
                        from_draft=[True] * len(drafts) + [False] * len(rest))
    assert split_draft_text(tokenizer, before, chunk) == ("argv", "):")
    plain = StreamChunk(request_id="r", seq=1, token_ids=ids, text="argv):", from_draft=[False] * len(ids))
    assert split_draft_text(tokenizer, before, plain) == ("", "argv):")


async def test_stack_start_fails_with_the_log_of_a_process_that_died(tmp_path):
    config = StackConfig(schedulers=1, verifiers=0, drafters=0, postprocessors=1, log_dir=tmp_path,
                         target_model=str(TINY_TARGET),
                         role_args={"scheduler": ["--max-queue", "many"]}, ready_timeout_s=60)
    stack = Stack(config)
    with pytest.raises(StackError, match=r"(?s)scheduler-0 exited with code 2 while starting.*field: max_queue"):
        await stack.start()
    assert not any(p.running for p in stack.processes.values())
    assert stack.server is not None and not stack.server.running
    assert (tmp_path / "scheduler-0.log").exists()  # a given log dir is kept


def test_stack_config_refuses_unknown_roles():
    with pytest.raises(ValueError, match="unknown role 'gpu'"):
        StackConfig(role_args={"gpu": []})


def test_stack_config_with_auth_makes_its_own_users():
    with pytest.raises(ValueError, match="set auth=False to bring yours"):
        StackConfig(nats=NatsServerConfig(users=(NatsUser("someone", "Some-password-123"),)))
    with pytest.raises(SpecbusError, match="clashes with the scheduler role"):
        StackConfig(client_users=("scheduler",))


def only_postprocessors(count=1, **options) -> StackConfig:
    """A stack of torch-free services only: starts in seconds."""
    return StackConfig(schedulers=0, verifiers=0, drafters=0, postprocessors=count, ready_timeout_s=60,
                       target_model=str(TINY_TARGET), **options)


async def test_stack_kills_and_restarts_instances():
    async with Stack(only_postprocessors()) as stack:
        first = stack.processes["postprocessor-0"]
        stack.kill("postprocessor-0", signal.SIGKILL)
        assert await stack.wait_exit("postprocessor-0") == -signal.SIGKILL
        second = await stack.start_instance("postprocessor")
        assert second.instance_id == "postprocessor-1" and stack.heartbeats["postprocessor-1"].role == "postprocessor"
        again = await stack.start_instance("postprocessor", "postprocessor-0")  # same id, fresh process
        assert again.running and again.process.pid != first.process.pid
        assert [p.instance_id for p in stack.by_role("postprocessor")] == ["postprocessor-0", "postprocessor-1"]
        running = [p.process for p in stack.processes.values()]
    assert all(process.returncode is not None for process in running)


async def test_up_restarts_a_service_that_dies_and_exits_1_on_a_crash_loop(tmp_path):
    """A killed service comes back as a new instance (the supervisor, services/launch/supervisor.py);
    one killed again each time it comes back is a crash loop: `up` gives up and exits 1."""
    async with specbus_process("up", "--port", "0", "--schedulers", "0", "--verifiers", "0", "--drafters", "0",
                               "--gateways", "0", "--target-model", str(TINY_TARGET), "--clients", "alice,bob",
                               "--log-dir", str(tmp_path),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        url = (await asyncio.wait_for(process.stdout.readline(), timeout=30)).decode().strip()
        ready = (await asyncio.wait_for(process.stdout.readline(), timeout=60)).decode()
        assert ready.startswith(f"ready: 0 scheduler, 0 verifier, 0 drafter, 1 postprocessor on {url}")
        credentials = (await asyncio.wait_for(process.stdout.readline(), timeout=10)).decode()
        assert credentials.startswith("credentials: ") and "client user 'alice'" in credentials
        client_env = Path(credentials.split()[1])
        assert client_env.stat().st_mode & 0o777 == 0o600  # NATS auth is on by default
        for user in ("alice", "bob"):
            login = dict(line.split("=", 1) for line in (tmp_path / f"client-{user}.env").read_text().splitlines())
            assert login["SPECBUS_NATS_USER"] == user
            nc = await connect(url, "pytest", user=user, password=login["SPECBUS_NATS_PASSWORD"])
            await nc.close()
        with pytest.raises(BusUnavailable, match="(?i)authorization"):
            await connect(url, "pytest-anonymous", initial_connect_timeout_s=2.0)

        for index in range(5):  # the default policy: 5 exits of one role within 60 s is a loop
            instance = f"postprocessor-{index}"
            pid = await poll(lambda: next(iter(pids_with_arg(url, f"--instance-id\0{instance}\0")), None))
            if index == 1:  # the first replacement serves: it heartbeats
                await wait_for_heartbeat(url, tmp_path, instance)
            os.kill(pid, signal.SIGKILL)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 1
        stderr = (await process.stderr.read()).decode()
    assert "stack_process_restarted" in stderr and "postprocessor-4" in stderr
    assert "error: postprocessor exited 5 times within 60 s (the last, postprocessor-4, with code -9)" in stderr


async def poll(probe, timeout_s: float = 60.0, interval_s: float = 0.05):
    """probe()'s first value that is not None, polling up to timeout_s."""
    async with asyncio.timeout(timeout_s):
        while (value := probe()) is None:
            await asyncio.sleep(interval_s)
    return value


async def wait_for_heartbeat(url: str, log_dir: Path, instance_id: str) -> None:
    """Until instance_id heartbeats (read as the stack's "monitor" user)."""
    secrets = dict(line.split("=", 1) for line in (log_dir / "credentials.env").read_text().splitlines())
    nc = await connect(url, "pytest-monitor", user="monitor", password=secrets[password_env("monitor")])
    try:
        beats = await nc.subscribe(Subjects().heartbeat)
        async with asyncio.timeout(60):
            while decode((await beats.next_msg(timeout=60)).data, Heartbeat).instance_id != instance_id:
                pass
    finally:
        await nc.close()


def pids_with_arg(*texts: str) -> list[int]:
    """Pids whose command line contains each of texts."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and all(text.encode() in (entry / "cmdline").read_bytes() for text in texts):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return pids


async def test_services_stop_by_themselves_when_the_stack_is_killed():
    async with specbus_process("up", "--port", "0", "--schedulers", "0", "--verifiers", "0", "--drafters", "0",
                               "--gateways", "0", "--target-model", str(TINY_TARGET),
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as process:
        url = (await asyncio.wait_for(process.stdout.readline(), timeout=30)).decode().strip()
        await asyncio.wait_for(process.stdout.readline(), timeout=60)  # ready
        service_pid = pids_with_arg(url)[0]
        server_pids = [pid for pid in children_of(process.pid) if pid != service_pid]
        process.kill()
        await process.wait()
        for _ in range(100):  # the service polls its parent every second
            if not pids_with_arg(url):
                break
            await asyncio.sleep(0.1)
        assert not pids_with_arg(url), "the service outlived its stack"
    for pid in server_pids:  # the orphaned nats-server has no such watchdog
        os.kill(pid, signal.SIGTERM)


def children_of(parent_pid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after ")"
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent_pid:
                pids.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return pids


async def test_up_with_a_nats_cluster_gives_every_node_and_stops_cleanly_on_ctrl_c(tmp_path):
    """`specbus up --nats-cluster 3`: the URL line lists three nodes, a service's heartbeats reach
    a reader on each node (over the routes), and Ctrl-C (SIGINT to the whole process group, as a
    terminal sends it) stops every service cleanly before the nodes (exit 0, no service exits
    with an error: the nodes, in their own sessions, outlive the services' drain)."""
    async with specbus_process("up", "--port", "0", "--nats-cluster", "3", "--schedulers", "0", "--verifiers", "0",
                               "--drafters", "0", "--gateways", "0", "--target-model", str(TINY_TARGET),
                               "--log-dir", str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True) as process:  # a group of its own, as in a terminal
        url = (await asyncio.wait_for(process.stdout.readline(), timeout=30)).decode().strip()
        nodes = url.split(",")
        assert len(nodes) == 3 and all(node.startswith("nats://127.0.0.1:") for node in nodes)
        ready = (await asyncio.wait_for(process.stdout.readline(), timeout=60)).decode()
        assert ready.startswith(f"ready: 0 scheduler, 0 verifier, 0 drafter, 1 postprocessor on {url}")
        for node in nodes:
            await wait_for_heartbeat(node, tmp_path, "postprocessor-0")
        os.killpg(process.pid, signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0
        stderr = (await process.stderr.read()).decode()
    assert "stack_process_stopped          instance_id=postprocessor-0 returncode=0" in stderr
    assert stderr.count("nats_server_stopped") == 3


async def test_up_prints_which_path_each_op_runs_in_its_verifiers():
    async with specbus_process("up", "--port", "0", "--http-port", "0", "--schedulers", "0", "--verifiers", "1",
                               "--drafters", "0", "--postprocessors", "0", "--gateways", "0", "--no-auth",
                               "--target-model", str(TINY_TARGET), "--dtype", "float32", "--weights", "dense",
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as process:
        lines = []
        async with asyncio.timeout(300):
            while not (lines and lines[-1].startswith("kernel paths")):
                line = await process.stdout.readline()
                assert line, f"up ended its output without the kernel paths: {lines}"
                lines.append(line.decode().rstrip())
            paths = [(await process.stdout.readline()).decode().split() for _ in range(7)]
        assert lines[1].startswith("ready: 0 scheduler, 1 verifier, 0 drafter, 0 postprocessor")
        assert lines[-1].startswith("kernel paths (loaded): ISA ") and "dtype float32, weights dense" in lines[-1]
        assert [p[0] for p in paths] == ["projection", "dequantization", "norms", "rope", "attention", "kv", "gumbel"]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0
