"""Fixtures shared across tests/: a real nats-server per test (own free port, own temp dir) and a
client; `start_stack`, the one way a test module starts a multi-process Stack; the model pairs
tests load, each written or copied once per session (tests/tiny_checkpoints.py writes them);
the slot owner of the slot tests; the pulled SmolLM2 pair for `real_model` tests.

A module that runs a stack defines its own `stack` fixture with its settings, in two lines:

    @pytest_asyncio.fixture(scope="module", loop_scope="module")
    async def stack(start_stack, tiny_random_pair):
        async with start_stack(*tiny_random_pair, role_args={"scheduler": ["--max-queue", "4"]}) as running:
            yield running

Model fixtures are read-only: a test that needs a changed checkpoint copies it first. Fixtures
only for tests/system/ are in tests/system/conftest.py; a module's own workload (its `prompts`)
stays in the module. No test module imports a fixture from another.
"""

import asyncio
import contextlib
import os
import shutil
from pathlib import Path

import pytest
import pytest_asyncio

from schemas.bus.codec import decode
from schemas.config import DEFAULT_DRAFT, TINY_DRAFT, TINY_TARGET, default_target_model
from schemas.bus.control import Heartbeat
from schemas.bus.subjects import DEFAULT_CLIENT_USER, Subjects
from services.launch.natsserver import NatsServer, NatsServerConfig
from services.launch.stack import Stack, StackConfig
from services.launch.supervisor import RestartPolicy, supervise
from services.runtime.auth import inbox_prefix
from services.runtime.bus import connect

# Tests use the tiny pair (fast) and pass it explicitly: the services' default is SmolLM2. They run
# in float32 on every machine (dtype "auto" picks bf16 where the CPU has it), so their references
# hold; a test about another dtype passes it explicitly (a flag wins over SPECBUS_DTYPE).
os.environ.setdefault("SPECBUS_DTYPE", "float32")


@pytest.fixture
def nats_server():
    """A fresh embedded nats-server (max_payload 8 MiB) on a port it picked itself."""
    with NatsServer(NatsServerConfig()) as server:
        yield server


@pytest.fixture
async def nc(nats_server):
    """A client connected to `nats_server` with the default client user's inbox prefix, as a
    Client without a login has; reconnects quickly so restart tests stay short."""
    client = await connect(nats_server.url, "pytest", initial_connect_timeout_s=5.0, reconnect_time_wait_s=0.1,
                           inbox_prefix=inbox_prefix(DEFAULT_CLIENT_USER))  # a scheduler answers only there
    yield client
    await client.close()


async def wait_for_heartbeats(nc, instance_ids, timeout_s: float = 60.0) -> None:
    """Until each of instance_ids has published a heartbeat (default subject prefix)."""
    seen: set[str] = set()
    beats = await nc.subscribe(Subjects().heartbeat)
    try:
        async with asyncio.timeout(timeout_s):
            while not set(instance_ids) <= seen:
                seen.add(decode((await beats.next_msg(timeout=timeout_s)).data, Heartbeat).instance_id)
    finally:
        await beats.unsubscribe()


# ---------------------------------------------------------------------------------------------
# stacks


@pytest.fixture(scope="session")
def start_stack(tmp_path_factory):
    """start_stack(target=None, draft=None, *, supervised=False, **settings): an async context
    manager that runs a Stack of StackConfig(target_model=target, draft_model=draft, **settings)
    and stops it on exit. log_dir defaults to a fresh temp dir (kept after the session, for a
    failure's logs). supervised: True or a RestartPolicy runs services.launch.supervisor.supervise
    over it as `specbus up` does (what a test kills comes back by itself); the replacements it
    started are printed on exit."""

    @contextlib.asynccontextmanager
    async def start(target: Path | str | None = None, draft: Path | str | None = None, *,
                    supervised: bool | RestartPolicy = False, **settings):
        models = {"target_model": target, "draft_model": draft}
        settings = {name: str(path) for name, path in models.items() if path is not None} | settings
        settings.setdefault("log_dir", tmp_path_factory.mktemp("stack-logs"))
        async with Stack(StackConfig(**settings)) as running:
            if not supervised:
                yield running
                return
            stop = asyncio.Event()
            policy = supervised if isinstance(supervised, RestartPolicy) else RestartPolicy()
            supervisor = asyncio.create_task(supervise(running, stop, policy))
            try:
                yield running
            finally:
                stop.set()
                print(f"\nreplacements started by the supervisor: {await supervisor}")

    return start


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(stack):
    """A Client logged in to the module's own `stack` fixture (each stack module defines one)."""
    async with stack.client() as connected:
        yield connected


# ---------------------------------------------------------------------------------------------
# models (imported inside the fixtures: a run that needs none, tests/test_docs.py, imports no torch)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A copy of the shipped tiny pair (models/tiny/target and draft): checkpoints in models/ may
    be rewritten while tests run, and every process of a session loads the same copy."""
    root = tmp_path_factory.mktemp("tiny-pair")
    return shutil.copytree(TINY_TARGET, root / "target"), shutil.copytree(TINY_DRAFT, root / "draft")


@pytest.fixture(scope="session")
def tiny_random_pair(tmp_path_factory) -> tuple[Path, Path]:
    """tests/tiny_checkpoints.py write_tiny_pair: a random target over the shipped tokenizer
    (vocab VT) and a random draft over VD ids with a many-to-one d2t map."""
    from tests.tiny_checkpoints import write_tiny_pair
    return write_tiny_pair(tmp_path_factory.mktemp("tiny-random-pair"))


@pytest.fixture(scope="session")
def chatml_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny random pair whose target tokenizer has a ChatML chat template (tiny_checkpoints.CHATML)."""
    from tests.tiny_checkpoints import CHATML, add_chat_template, write_tiny_pair
    target, draft = write_tiny_pair(tmp_path_factory.mktemp("chatml-pair"))
    return add_chat_template(target, CHATML), draft


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """tests/tiny_checkpoints.py write_model_dirs: target, draft and twin over a trained tokenizer."""
    from tests.tiny_checkpoints import write_model_dirs
    return write_model_dirs(tmp_path_factory.mktemp("model-dirs"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (tiny_checkpoints.TINY, seed 1) without a tokenizer."""
    from tests.tiny_checkpoints import write_hf_model
    path = tmp_path_factory.mktemp("model")
    write_hf_model(path, "llama", seed=1)
    return path


@pytest.fixture
def owner(model_dir):
    """A fresh tests/slot_owner.py Owner over model_dir's KV cache."""
    from tests.slot_owner import new_owner
    return new_owner(model_dir)


@pytest.fixture(scope="session")
def smollm2_target() -> Path:
    """The pulled SmolLM2-135M-Instruct directory; skips the test when it is not pulled."""
    path = Path(default_target_model())
    if not (path / "config.json").exists():
        pytest.skip(f"SmolLM2 is not pulled into {path}: run `specbus models pull` (`make test` does)")
    return path


@pytest.fixture(scope="session")
def smollm2_draft() -> Path:
    """The shipped SmolLM2 draft (models/smollm2-draft); skips the test when it is missing."""
    if not (DEFAULT_DRAFT / "config.json").exists():
        pytest.skip(f"{DEFAULT_DRAFT} is missing (ops/train/distill_draft.py makes it)")
    return DEFAULT_DRAFT
