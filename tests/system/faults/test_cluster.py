"""A 3-node NATS cluster: the embedded stack with `nats_cluster=3`, every service a
separate process given all three URLs, and the node one process is connected to SIGKILLed
while NUM_REQUESTS streams run (triggered when every stream has FAULT_AFTER_CHUNKS
chunks, not by wall time; the workload of tests/system/faults/test_faults.py's fault matrix, which runs it in
float32); then, on the same stack, the drafter SIGKILLed the same way.

Which node a process is on comes from each node's /connz monitoring endpoint (the connection
named after the instance); the test's own client reads `nc.connected_url`. What a user checks:
every stream equals the undisturbed run token for token and is whole. The stack runs in bfloat16, and
half the streams are seeded samples coupled by Gumbel noise (their tokens depend on the seed only,
not on which steps lost their drafts), so the identity is the bitwise one of docs/PROTOCOL.md,
across a node loss and across a drafter kill. The connections of the
dead node move to the others; what the node held in flight is recovered: verify and draft
replies by the scheduler's retries, a chunk or a commit lost for good by the client's failover
(the rest run again from the tokens it has, flagged `failover`). The cluster serves identical
outputs again afterwards.
"""

import asyncio
import json
import time
import urllib.request
from collections import Counter

import pytest
import pytest_asyncio

from services.launch.natsserver import NatsCluster, NatsServer, NatsServerConfig
from services.launch.stack import Stack
from tests.system.faults.test_faults import (
    Load,
    Streamed,
    check_whole,
    fault_settings,
    heartbeats_since,
    kill,
    mixed_requests,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

NODES = 3
MAX_TOKENS = 96


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, noisy_pair):
    settings = fault_settings(nats_cluster=NODES, dtype="bfloat16",
                              nats=NatsServerConfig(http_port=0))  # /connz says which node each process is on
    async with start_stack(*noisy_pair, **settings) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(client, prompts) -> list[list[int]]:
    """Outputs of an undisturbed run on the cluster."""
    results = await asyncio.gather(*(client.generate(r) for r in mixed_requests(prompts, "reference", MAX_TOKENS)))
    assert all(r.finish_reason == "length" and len(r.token_ids) == MAX_TOKENS for r in results)
    return [r.token_ids for r in results]


def connection_names(stack: Stack) -> dict[str, list[str]]:
    """node name -> the names of the connections it holds (for the test's report)."""
    return {node.config.server_name: sorted(c.get("name", "") for c in connections(node))
            for node in stack.server.nodes if node.running}


def connections(node: NatsServer) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.monitoring_port}/connz?auth=1&limit=1024", timeout=5) as reply:
        return json.load(reply)["connections"] or []


async def node_of(stack: Stack, instance_id: str) -> NatsServer:
    """The node a service instance is connected to (its connection is named after the instance:
    `<id>` or `<role>-<id>`)."""
    role = stack.processes[instance_id].role
    names = {instance_id, f"{role}-{instance_id}"}
    cluster: NatsCluster = stack.server
    async with asyncio.timeout(30):
        while True:
            on = [node for node in cluster.nodes if node.running
                  and any(c.get("name") in names for c in await asyncio.to_thread(connections, node))]
            if len(on) == 1:
                return on[0]
            await asyncio.sleep(0.2)  # between nodes while reconnecting


def client_node(stack: Stack, client) -> NatsServer:
    return next(node for node in stack.server.nodes if node.port == client.nc.connected_url.port)


def outcome(got: Streamed, expected: list[int]) -> str:
    """What one stream came to: "identical", "identical, failover" (a chunk or commit the dead
    node held was lost, and the client's failover ran the rest again from the tokens it had), or
    the client's error."""
    if got.error is not None:
        return f"{type(got.error).__name__}: {got.error.message}"
    if got.finish_reason != "length" or got.token_ids != expected:
        return f"different output ({got.finish_reason}, {len(got.token_ids)} tokens)"
    return "identical, failover" if "failover" in got.degraded() else "identical"


@pytest.mark.parametrize("victim", ["scheduler-0", "postprocessor-0", "client"])
async def test_the_node_a_process_is_on_dies_and_streams_finish(stack, client, prompts, reference, tokenizer, victim):
    load = await Load.start(client, mixed_requests(prompts, f"kill-node-of-{victim}", MAX_TOKENS))
    node = client_node(stack, client) if victim == "client" else await node_of(stack, victim)
    placement = await asyncio.to_thread(connection_names, stack)
    node.process.kill()
    await asyncio.to_thread(node.process.wait, 10)
    killed_at = time.monotonic()
    streams = await load.finish()

    outcomes = Counter(outcome(got, expected) for got, expected in zip(streams, reference))
    print(f"\nkilled {node.config.server_name}, the node of {victim}; connections were {placement}; "
          f"outcomes {dict(outcomes)}")
    assert set(outcomes) <= {"identical", "identical, failover"}, outcomes
    for got in streams:
        check_whole(got, tokenizer)

    await asyncio.to_thread(node.restart)  # the same ports: the other nodes' routes find it again
    await heartbeats_since(stack, list(stack.processes), killed_at)
    again = await asyncio.gather(*(client.generate(r) for r in mixed_requests(prompts, f"after-{victim}", MAX_TOKENS)))
    assert [r.token_ids for r in again] == reference


async def test_a_killed_drafter_changes_no_stream(stack, client, prompts, reference, tokenizer):
    """The fault matrix's drafter row in bfloat16: the steps after the kill run without drafts
    (`draft_timeout`), which changes neither a greedy stream nor a Gumbel-coupled sample. The
    drafter is started again afterwards, so the stack is whole for whatever runs next."""
    load = await Load.start(client, mixed_requests(prompts, "kill-drafter", MAX_TOKENS))
    [drafter] = stack.by_role("drafter")
    killed_at = await kill(stack, drafter.instance_id)
    streams = await load.finish()

    outcomes = Counter(outcome(got, expected) for got, expected in zip(streams, reference))
    assert set(outcomes) == {"identical"}, outcomes
    for got in streams:
        check_whole(got, tokenizer)
    assert any("draft_timeout" in got.degraded(since=killed_at) for got in streams)  # the kill reached them
    await stack.start_instance("drafter", drafter.instance_id)
