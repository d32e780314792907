"""The fault harness, Jepsen's way: a workload of concurrent streams, a nemesis that injects
faults on a schedule, a recorded history, and a checker over it (ops/faults/chaos_check.py).

    make chaos                                   # 30 minutes, a fault every few seconds
    python -m ops.faults.chaos --duration-s 120 --streams 16 --every-s 4 --out /tmp/chaos

The stack (services/launch/stack.py, supervised as `specbus up` supervises it): a 3-node NATS
cluster, 2 schedulers, 2 verifiers, 1 drafter, 2 postprocessors and 1 gateway, each NATS node
and each service in a network namespace of its own joined by veth pairs (ops/faults/netns.py; the
gateway and the clients stay in the root namespace, where they reach every node). The
services' clocks are skewed (CLOCK_OFFSETS, schemas/bus/clock.py), so every fault also runs under
clocks seconds apart. Needs root.

The workload (`workload`): specs sent again and again by `streams` workers, each spec always
the same request: greedy, seeded samples (Gumbel-coupled, so no fault may change them), with
logprobs, with a regex grammar, sharing a long prompt prefix (prefix-cache hits), and through
the gateway's OpenAI API. Every spec's fault-free output is recorded first (`references`).

The nemesis (FAULTS, each injected, held `hold_s`, healed, then the stack settles):
- partition-scheduler-minority / -majority: the NATS node a scheduler is on cut from its peers
  (the scheduler on the minority side), or a node it is not on (it stays with the majority);
- cut-scheduler, cut-verifier: a service cut from every NATS node while its process lives on
  (it keeps computing, and publishes late once healed);
- throttle-verifier: a verifier's link through a token bucket (THROTTLE_RATE);
- stall-node: a NATS node SIGSTOPped (it holds its connections and answers nothing), then
  SIGCONTed;
- gray-verifier: a verifier that heartbeats but never finishes a batch (the test-only hook in
  tests/system/faults/gray_hook/);
- kill-drafter-and-node: the drafter and the NATS node it is on, SIGKILLed together;
- kill-schedulers-and-node: every scheduler and the node of the first, SIGKILLed together (the
  supervisor brings schedulers back; the node restarts at the heal);
- rolling-restart: every service stopped (SIGTERM) and replaced, one after the other;
- rolling-upgrade: the same, each replacement speaking the next protocol version too
  (SPECBUS_PROTOCOL_VERSION, window [N, N+1]: schemas/bus/versions.py), and on its next turn back
  to this release's window [N, N]: versions mix while it runs (docs/PROTOCOL.md#version-rule).

Recovery times (ops/faults/chaos_check.py `recovery`): for the streams in flight when a fault began,
the wait from its heal to their next chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai

from ops.faults.chaos_check import FaultEvent, Record, Verdict, check, write_history
from ops.faults.netns import Namespaces
from ops.train.train_models import read_text, source_files
from schemas.bus.clock import CLOCK_OFFSET_ENV
from schemas.bus.protocol import PROTOCOL_VERSION
from schemas.bus.versions import VERSION_ENV
from schemas.config import TINY_DRAFT, TINY_TARGET
from services.client import Client, ClientError, make_request
from services.launch.natsserver import NatsServer, NatsServerConfig
from services.launch.stack import Stack, StackConfig
from services.launch.supervisor import supervise

REPO = Path(__file__).resolve().parents[2]
GRAY_HOOK = REPO / "tests" / "system" / "faults" / "gray_hook"
K = 4
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.5
VERIFY_TIMEOUT_S = 2.0
DRAFT_TIMEOUT_S = 0.5
REQUEST_TIMEOUT_S = 240.0  # generous: a fault held for seconds must never be what ends a request
CLIENT_IDLE_S = 30.0
SETTLE_S = 180.0  # bound of the wait for a whole stack after a heal (a replacement's imports)
THROTTLE_RATE = "1mbit"
REFUSED_PAUSE_S = 0.5  # a worker's pause after a request was refused (not admitted)
# Each role's clock, seconds off the true one: up to 12 s apart, under MAX_CLOCK_SKEW_S's 10 s
# from any one sender to any one receiver of a deadline (scheduler -> verifier, drafter).
CLOCK_OFFSETS = {"scheduler": -3.0, "verifier": 6.0, "drafter": -6.0, "postprocessor": 4.0}
FAULTS = ("partition-scheduler-minority", "partition-scheduler-majority", "cut-scheduler", "cut-verifier",
          "throttle-verifier", "stall-node", "gray-verifier", "kill-drafter-and-node", "kill-schedulers-and-node",
          "rolling-restart", "rolling-upgrade")
REGEX = "[a-z_]{2,10}( [a-z_]{2,10}){3,8}"
SAMPLED = dict(temperature=0.8, top_p=0.95, draft_mode="sample", coupling="gumbel")


@dataclass(frozen=True)
class Spec:
    """One request of the workload, sent the same way every time."""

    index: int
    via: str  # "client" or "gateway"
    prompt: str
    options: tuple[tuple[str, object], ...]


def workload(count: int, max_tokens: int) -> list[Spec]:
    """count specs cycling through the kinds of the module docstring, over windows of a
    held-out stdlib files (text the tiny pair was not trained on)."""
    text = "".join(read_text(path) for path in source_files()[1][:8])
    shared = text[:600]  # a long common prefix: every "prefix" spec hits the prefix cache
    specs = []
    for i in range(count):
        window = text[600 + 160 * i: 600 + 160 * i + 160]
        base = dict(max_tokens=max_tokens, ignore_eos=True)
        kind = i % 8
        options = [dict(temperature=0.0), dict(SAMPLED, seed=100 + i), dict(temperature=0.0, logprobs=2),
                   dict(temperature=0.0, ignore_eos=False, structured_outputs={"regex": REGEX}),
                   dict(temperature=0.0), dict(SAMPLED, seed=100 + i, logprobs=1), dict(temperature=0.0),
                   dict(temperature=0.8, top_p=0.95, seed=100 + i)][kind]
        prompt = shared + window if kind in (4, 5) else window
        specs.append(Spec(i, "gateway" if kind in (6, 7) else "client", prompt, tuple({**base, **options}.items())))
    return specs


def stack_config(net: Namespaces, gray_dir: Path, log_dir: Path, target: str, draft: str) -> StackConfig:
    beat = ["--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S)]
    role_env = {role: {CLOCK_OFFSET_ENV: str(offset)} for role, offset in CLOCK_OFFSETS.items()}
    role_env["verifier"] |= {"SPECBUS_TEST_GRAY_DIR": str(gray_dir),
                             "PYTHONPATH": os.pathsep.join([str(GRAY_HOOK), str(REPO), os.environ.get("PYTHONPATH", "")])}
    return StackConfig(
        schedulers=2, verifiers=2, drafters=1, postprocessors=2, gateways=1, nats_cluster=3, placement=net,
        target_model=target, draft_model=draft, log_dir=log_dir, nats=NatsServerConfig(http_port=0),
        role_env=role_env,
        role_args={"scheduler": [*beat, "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), "--adaptive-k", "false",
                                 "--verify-timeout-s", str(VERIFY_TIMEOUT_S), "--draft-timeout-s", str(DRAFT_TIMEOUT_S)],
                   "verifier": [*beat, "--max-seq-len", "768"], "drafter": [*beat, "--max-seq-len", "768"],
                   "postprocessor": beat})


def connections(node: NatsServer) -> list[dict]:
    url = f"http://{node.config.host}:{node.monitoring_port}/connz?limit=1024"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.load(reply)["connections"] or []


@dataclass
class Harness:
    """A running stack in namespaces, its clients, and the history so far."""

    stack: Stack
    net: Namespaces
    client: Client
    api: openai.AsyncOpenAI
    model: str
    gray_dir: Path
    records: list[Record] = field(default_factory=list)
    faults: list[FaultEvent] = field(default_factory=list)
    sent: itertools.count = field(default_factory=itertools.count)

    # ---- workload
    async def run(self, spec: Spec) -> Record:
        record = Record(spec.index, f"chaos-{spec.index}-{next(self.sent)}", spec.via, time.monotonic())
        self.records.append(record)
        try:
            await (self.via_client(spec, record) if spec.via == "client" else self.via_gateway(spec, record))
        finally:
            record.ended = time.monotonic()
        return record

    async def via_client(self, spec: Spec, record: Record) -> None:
        request = make_request(spec.prompt, request_id=record.request_id, timeout_s=REQUEST_TIMEOUT_S,
                               num_speculative_tokens=K, **dict(spec.options))
        async with await self.client.open_stream(request) as stream:
            try:
                async for chunk in stream:
                    record.chunks.append((time.monotonic(), chunk.seq, len(chunk.token_ids)))
                    record.token_ids += chunk.token_ids.tolist()
                    record.text += chunk.text
                    record.logprobs += [t.logprob for t in chunk.logprobs] if chunk.logprobs is not None else \
                        [None] * len(chunk.token_ids)
                    record.degraded += [r for r in chunk.degraded if r not in record.degraded]
                    record.finish_reason = chunk.finish_reason or record.finish_reason
            except ClientError as exc:
                record.error_code, record.error = str(getattr(exc.code, "value", exc.code)), str(exc)

    async def via_gateway(self, spec: Spec, record: Record) -> None:
        options = dict(spec.options)
        body = {"ignore_eos": options.pop("ignore_eos"), "num_speculative_tokens": K, "timeout_s": REQUEST_TIMEOUT_S}
        try:
            stream = await self.api.completions.create(model=self.model, prompt=spec.prompt, stream=True,
                                                       extra_body=body, **options)
            async for event in stream:
                choice = event.choices[0]
                record.chunks.append((time.monotonic(), len(record.chunks), 1))
                record.text += choice.text
                record.finish_reason = choice.finish_reason or record.finish_reason
        except openai.APIStatusError as exc:
            record.http_status, record.error_code, record.error = exc.status_code, str(exc.code or exc.status_code), str(exc)
        except openai.APIError as exc:  # an error event inside the stream: typed by its code
            record.error_code, record.error = str(getattr(exc, "code", None) or "untyped"), str(exc)

    async def references(self, specs: list[Spec], streams: int) -> dict[int, Record]:
        """Every spec once, fault-free, `streams` at a time."""
        gate = asyncio.Semaphore(streams)

        async def one(spec: Spec) -> Record:
            async with gate:
                return await self.run(spec)
        done = await asyncio.gather(*(one(spec) for spec in specs))
        self.records.clear()
        bad = [r for r in done if r.error_code or r.http_status]
        if bad:
            raise RuntimeError(f"the fault-free run failed: {bad[0].request_id}: {bad[0].error}")
        return {r.spec: r for r in done}

    async def load(self, specs: list[Spec], streams: int, stop: asyncio.Event) -> None:
        """`streams` workers, each sending the next spec as soon as its last one ended, until stop."""
        order = itertools.cycle(specs)

        async def worker() -> None:
            while not stop.is_set():
                if (await self.run(next(order))).refused():
                    await asyncio.sleep(REFUSED_PAUSE_S)  # no scheduler now: do not spin
        await asyncio.gather(*(worker() for _ in range(streams)))

    # ---- nemesis
    def running(self, role: str) -> list[str]:
        return [p.instance_id for p in self.stack.by_role(role) if p.running]

    async def node_of(self, instance_id: str) -> NatsServer:
        role = self.stack.processes[instance_id].role
        names = {instance_id, f"{role}-{instance_id}"}
        for _ in range(100):
            for node in self.stack.server.nodes:
                if node.running and any(c.get("name") in names for c in await asyncio.to_thread(connections, node)):
                    return node
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{instance_id} is on no NATS node")

    def node_name(self, node: NatsServer) -> str:
        return f"nats-{self.stack.server.nodes.index(node)}"

    async def inject(self, name: str):
        """Start fault `name`; returns (its victims, the coroutine function that heals it)."""
        nodes = self.stack.server.nodes
        if name.startswith("partition-scheduler-"):
            home = await self.node_of(self.running("scheduler")[0])
            node = home if name.endswith("minority") else next(n for n in nodes if n is not home)
            isolated = self.node_name(node)
            self.net.partition([isolated], [self.node_name(n) for n in nodes if n is not node])
            return [isolated], self.heal_net
        if name.startswith("cut-"):
            victim = self.running(name.removeprefix("cut-"))[0]
            self.net.cut(victim)
            return [victim], self.heal_net
        if name == "throttle-verifier":
            victim = self.running("verifier")[0]
            self.net.throttle(victim, THROTTLE_RATE)
            return [victim], self.heal_net
        if name == "stall-node":
            node = await self.node_of(self.running("scheduler")[0])
            os.kill(node.process.pid, signal.SIGSTOP)
            return [self.node_name(node)], lambda: self.signal_node(node, signal.SIGCONT)
        if name == "gray-verifier":
            victim = self.running("verifier")[0]
            (self.gray_dir / victim).touch()
            return [victim], lambda: self.ungray(victim)
        if name.startswith("kill-"):
            role = "drafter" if name == "kill-drafter-and-node" else "scheduler"
            victims = self.running(role) if role == "scheduler" else self.running(role)[:1]
            node = await self.node_of(victims[0])
            node.process.kill()
            for victim in victims:
                self.stack.kill(victim, signal.SIGKILL)
            return [*victims, self.node_name(node)], lambda: asyncio.to_thread(node.restart)
        if name == "rolling-restart":
            return ["every service"], self.rolling_restart
        if name == "rolling-upgrade":
            return ["every service"], self.rolling_upgrade
        raise ValueError(f"fault: unknown {name!r}, expected one of {FAULTS}")

    async def heal_net(self) -> None:
        self.net.heal()

    async def signal_node(self, node: NatsServer, sig: int) -> None:
        os.kill(node.process.pid, sig)

    async def ungray(self, victim: str) -> None:
        (self.gray_dir / victim).unlink(missing_ok=True)

    async def rolling_restart(self) -> None:
        """Each service in turn: SIGTERM, then wait for the supervisor's replacement to be whole."""
        for proc in [p for p in self.stack.processes.values() if p.running and p.role != "gateway"]:
            self.stack.kill(proc.instance_id, signal.SIGTERM)
            await self.stack.wait_exit(proc.instance_id, timeout_s=60)
            await self.settle()

    async def rolling_upgrade(self) -> None:
        """rolling_restart, the supervisor's replacements speaking [N, N+1] (or, when the last run
        upgraded, [N, N] again): every window holds N throughout, the rule of an upgrade."""
        envs = [self.stack.config.role_env.setdefault(role, {}) for role in CLOCK_OFFSETS]
        upgrade = not any(VERSION_ENV in env for env in envs)
        for env in envs:
            if upgrade:
                env[VERSION_ENV] = str(PROTOCOL_VERSION + 1)
            else:
                env.pop(VERSION_ENV, None)
        await self.rolling_restart()

    async def settle(self) -> None:
        """Until every NATS node runs and every service of the configured counts heartbeats."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            now = time.monotonic()
            beating = {role: sum(1 for p in self.stack.by_role(role) if p.running and (
                role == "gateway" or now - self.stack.heartbeat_seen_at.get(p.instance_id, -1e9) < 1.0))
                for role in ("scheduler", "verifier", "drafter", "postprocessor", "gateway")}
            if all(n.running for n in self.stack.server.nodes) and \
                    all(beating[role] >= self.stack.config.count(role) for role in beating):
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the stack was not whole again within {SETTLE_S} s")

    async def warm(self, streams: int) -> None:
        """Until the load has ended `streams` requests: every worker is past its first, so the
        streams are at all stages when a fault comes."""
        deadline = time.monotonic() + SETTLE_S
        while sum(1 for r in self.records if r.ended is not None) < streams:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the load did not get {streams} streams going within {SETTLE_S} s")
            await asyncio.sleep(0.05)

    async def nemesis(self, names: list[str], hold_s: float, every_s: float, until: float) -> None:
        """Each fault of names in turn (cycling) until time.monotonic() passes `until`; every
        fault runs once even past it."""
        for index in itertools.count():
            if index >= len(names) and time.monotonic() > until:
                return
            name = names[index % len(names)]
            event = FaultEvent(name, [], time.monotonic())
            event.victims, heal = await self.inject(name)
            self.faults.append(event)
            print(f"fault {name} on {event.victims}", flush=True)
            await asyncio.sleep(hold_s)
            await heal()
            event.healed = time.monotonic()
            await self.settle()
            await asyncio.sleep(every_s)


async def chaos(streams: int, specs: int, max_tokens: int, faults: list[str], hold_s: float, every_s: float,
                duration_s: float, out: Path, target: str = str(TINY_TARGET), draft: str = str(TINY_DRAFT),
                allow_errors: bool = False, client_idle_s: float = CLIENT_IDLE_S) -> Verdict:
    """Start the stack, record the references, run load and nemesis for duration_s (every fault
    at least once), let the streams end, write out/history.jsonl and out/summary.json."""
    out.mkdir(parents=True, exist_ok=True)
    gray_dir = out / "gray"
    gray_dir.mkdir(exist_ok=True)
    with Namespaces.create() as net:
        async with Stack(stack_config(net, gray_dir, out / "logs", target, draft)) as stack:
            stop_supervisor = asyncio.Event()
            supervisor = asyncio.create_task(supervise(stack, stop_supervisor))
            try:
                async with stack.client(idle_timeout_s=client_idle_s, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as client:
                    api = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key(), max_retries=0,
                                             timeout=REQUEST_TIMEOUT_S)
                    model = (await api.models.list()).data[0].id
                    harness = Harness(stack, net, client, api, model, gray_dir)
                    work = workload(specs, max_tokens)
                    started = time.monotonic()
                    references = await harness.references(work, streams)
                    print(f"references in {time.monotonic() - started:.1f} s", flush=True)
                    stop = asyncio.Event()
                    load = asyncio.create_task(harness.load(work, streams, stop))
                    try:
                        await harness.warm(streams)
                        await harness.nemesis(faults, hold_s, every_s, time.monotonic() + duration_s)
                    finally:
                        net.heal()
                        stop.set()
                        await asyncio.wait_for(load, REQUEST_TIMEOUT_S + 60)
                    verdict = check(harness.records, references, harness.faults, allow_errors=allow_errors)
                    write_history(out / "history.jsonl", harness.records, harness.faults, references)
                    (out / "summary.json").write_text(json.dumps(verdict.summary(), indent=1))
                    return verdict
            finally:
                stop_supervisor.set()
                await supervisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.faults.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--specs", type=int, default=32, help="distinct requests the workload cycles through")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--hold-s", type=float, default=4.0, help="how long each fault lasts")
    parser.add_argument("--every-s", type=float, default=3.0, help="quiet time between a heal and the next fault")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma separated, from {','.join(FAULTS)}")
    parser.add_argument("--out", type=Path, default=Path("chaos-out"))
    parser.add_argument("--client-idle-s", type=float, default=CLIENT_IDLE_S,
                        help="the workload client's idle bound (services/client.py idle_timeout_s)")
    args = parser.parse_args(argv)
    verdict = asyncio.run(chaos(args.streams, args.specs, args.max_tokens, args.faults.split(","), args.hold_s,
                                args.every_s, args.duration_s, args.out, client_idle_s=args.client_idle_s))
    print(json.dumps(verdict.summary(), indent=1))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
