"""A rolling upgrade across a protocol version bump, under load: every service of a stack (a real
nats-server, each service its own process) replaced, one at a time, by a process speaking the
next version as well (SPECBUS_PROTOCOL_VERSION=N+1: window [N, N+1]; schemas/versions.py), while
STREAMS lanes send requests back to back: a client library of version N, one of [N, N+1], and
the OpenAI API through the gateway (rolled too). What a user checks: no request fails, every
output equals the fault-free run's token for token (greedy, and seeded samples coupled by Gumbel
noise, which no lost draft may change), no process logged a message refused for its version (the
rehearsal version changes every message, so one sent in the wrong version would be refused), and
once every process speaks N+1, the new client's streams arrive in N+1 and the old one's in N.

The roll is a surge, as a Kubernetes rolling update with maxSurge 1: the new instance starts and
heartbeats, the old one gets SIGTERM (a scheduler hands its requests over with `shutting_down`,
the client sends them again; a verifier's requests move once it is silent; a postprocessor's
commits are replayed; the gateway finishes its responses) and exits, then the next role.
"""

import asyncio
import signal
import time
from dataclasses import dataclass, field

import openai
import pytest
import pytest_asyncio

from schemas.bus.protocol import PROTOCOL_VERSION
from schemas.bus.versions import VERSION_ENV, Window
from services.client import Client, ClientError, make_request
from services.launch.stack import Stack
from tests.system.faults.test_faults import GUMBEL_SAMPLED, HEARTBEAT_TIMEOUT_S, K, TIMEOUT_S, fault_settings, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

N = PROTOCOL_VERSION
STREAMS = 6  # lanes: 0, 3 the old client; 1, 4 the new client; 2, 5 the gateway
MAX_TOKENS = 32
# the scheduler first: from then on it must address its old peers in N, and every later step mixes versions
ROLL_ORDER = ("scheduler", "postprocessor", "verifier", "drafter", "gateway")
ENDED_PER_STEP = 4  # requests that end between two replacements: each mixed stage serves load


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, noisy_pair):
    async with start_stack(*noisy_pair, **fault_settings(gateways=1)) as running:
        yield running


@dataclass
class Run:
    """One request of a lane and what came back: token ids (the clients) or text (the gateway),
    the version of each chunk (the clients)."""

    lane: int
    prompt: int
    started: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    versions: set[int] = field(default_factory=set)
    finish_reason: str | None = None
    error: str | None = None
    ended: float | None = None

    @property
    def output(self) -> tuple:
        return (tuple(self.token_ids), self.text, self.finish_reason)


@dataclass
class Lanes:
    stack: Stack
    clients: dict[str, Client]  # "old", "new"
    gateway_url: str
    prompts: list[list[int]]
    runs: list[Run] = field(default_factory=list)

    def via(self, lane: int) -> str:
        return ("old", "new", "gateway")[lane % 3]

    def sampled(self, lane: int) -> bool:
        return lane % 2 == 1 and self.via(lane) != "gateway"

    def options(self, lane: int, prompt: int) -> dict:
        return dict(GUMBEL_SAMPLED, seed=700 + prompt) if self.sampled(lane) else dict(temperature=0.0)

    def kind(self, run: Run) -> tuple:
        """What fixes a run's output: the two clients' runs of one request are the same kind."""
        return self.sampled(run.lane), self.via(run.lane) == "gateway", run.prompt

    async def run(self, lane: int, prompt: int) -> Run:
        run = Run(lane, prompt, time.monotonic())
        self.runs.append(run)
        options = self.options(lane, prompt)
        try:
            if self.via(lane) == "gateway":
                await self.via_gateway(run, options)
            else:
                await self.via_client(self.clients[self.via(lane)], run, options)
        finally:
            run.ended = time.monotonic()
        return run

    async def via_client(self, client: Client, run: Run, options: dict) -> None:
        request = make_request(self.prompts[run.prompt], request_id=f"up-{run.lane}-{time.monotonic_ns()}",
                               max_tokens=MAX_TOKENS, ignore_eos=True, num_speculative_tokens=K, timeout_s=TIMEOUT_S,
                               **options)
        async with await client.open_stream(request) as stream:
            try:
                async for chunk in stream:
                    run.token_ids += chunk.token_ids.tolist()
                    run.versions.add(chunk.v)
                    run.finish_reason = chunk.finish_reason or run.finish_reason
            except ClientError as exc:
                run.error = repr(exc)

    async def via_gateway(self, run: Run, options: dict) -> None:
        api = openai.AsyncOpenAI(base_url=self.gateway_url, api_key=self.stack.api_key(), max_retries=0,
                                 timeout=TIMEOUT_S)
        try:
            stream = await api.completions.create(
                model=(await api.models.list()).data[0].id, prompt=self.prompts[run.prompt], max_tokens=MAX_TOKENS,
                stream=True, extra_body={"ignore_eos": True, "num_speculative_tokens": K}, **options)
            async for event in stream:
                run.text += event.choices[0].text
                run.finish_reason = event.choices[0].finish_reason or run.finish_reason
        except openai.APIError as exc:
            run.error = repr(exc)
        finally:
            await api.close()

    async def load(self, stop: asyncio.Event) -> None:
        async def lane(index: int) -> None:
            prompt = index
            while not stop.is_set():
                await self.run(index, prompt % len(self.prompts))
                prompt += 1
        await asyncio.gather(*(lane(i) for i in range(STREAMS)))

    def ended_since(self, since: float) -> int:
        return sum(1 for run in self.runs if run.ended is not None and run.started >= since)


async def replace(stack: Stack, lanes: Lanes, role: str) -> None:
    """Start an instance of role speaking [N, N+1], wait until it serves, SIGTERM the old one."""
    old = [p.instance_id for p in stack.by_role(role) if p.running]
    stack.config.role_env.setdefault(role, {})[VERSION_ENV] = str(N + 1)
    new = await stack.start_instance(role)
    if role == "gateway":
        lanes.gateway_url = f"http://127.0.0.1:{stack.gateway_ports[new.instance_id]}/v1"
    for instance_id in old:
        stack.kill(instance_id, signal.SIGTERM)
        assert await stack.wait_exit(instance_id, timeout_s=60) == 0, f"{instance_id} did not stop cleanly"


def refusals(stack: Stack) -> list[str]:
    """Log lines of a message refused for its version (or for the rehearsal's key)."""
    return [line for path in stack.log_dir.glob("*.log") for line in path.read_text(errors="replace").splitlines()
            if "unsupported_version" in line or "rehearsal" in line]


async def test_a_rolling_upgrade_across_a_version_bump_fails_no_request_and_changes_no_output(stack, prompts):
    async with stack.client(window=Window(N, N), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as old, \
            stack.client(window=Window(N, N + 1), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as new:
        lanes = Lanes(stack, {"old": old, "new": new}, stack.openai_base_url, prompts)
        references = {}
        for run in await asyncio.gather(*(lanes.run(lane, p) for lane in range(3) for p in range(len(prompts)))):
            assert run.error is None and run.finish_reason == "length", run
            references[lanes.kind(run)] = run.output
        lanes.runs.clear()

        stop = asyncio.Event()
        load = asyncio.create_task(lanes.load(stop))
        try:
            for role in ROLL_ORDER:
                since = time.monotonic()
                await wait_until(lambda: lanes.ended_since(since) >= ENDED_PER_STEP or load.done(),
                                 f"{ENDED_PER_STEP} requests ended before the {role} is replaced")
                await replace(stack, lanes, role)
            rolled = time.monotonic() + HEARTBEAT_TIMEOUT_S  # the old scheduler is forgotten by then
            await wait_until(lambda: lanes.ended_since(rolled) >= 2 * STREAMS or load.done(),
                             "requests ended after the roll")
        finally:
            stop.set()
            await asyncio.wait_for(load, TIMEOUT_S)

    failed = [run for run in lanes.runs if run.error is not None]
    changed = [run for run in lanes.runs if run.error is None and run.output != references[lanes.kind(run)]]
    print(f"\n{len(lanes.runs)} requests over a roll of {ROLL_ORDER}: {len(failed)} failed, {len(changed)} changed")
    assert not failed, failed[0]
    assert not changed, changed[0]
    assert not refusals(stack), refusals(stack)[:5]
    after = [run for run in lanes.runs if run.started >= rolled]
    assert {v for run in after if lanes.via(run.lane) == "new" for v in run.versions} == {N + 1}
    assert {v for run in lanes.runs if lanes.via(run.lane) == "old" for v in run.versions} == {N}
