"""The `specbus` command. Subcommands live in COMMANDS (name -> Command); add one there.

Lifecycle of a long-running command (STYLE.md 11): SIGINT/SIGTERM set an asyncio.Event, an
AsyncExitStack owns the server, connections and services, and unwinds them in reverse order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import structlog

from schemas.codec import decode, decode_any, encode, error_reply
from schemas.errors import SpecbusError
from schemas.messages import GenerateRequest, SamplingParams
from services.bus import BoundedHandler, Endpoint, add_micro_service, connect, request
from services.logs import LEVELS, configure_logging
from services.natsserver import DEFAULT_MAX_PAYLOAD, NatsServer, NatsServerConfig

log = structlog.get_logger(__name__)


def shutdown_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


# ---------------------------------------------------------------------------------------------
# specbus nats


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    parser.add_argument("--port", type=int, default=4222, help="client port; 0 picks a free one (default 4222)")
    parser.add_argument("--max-payload", type=int, default=DEFAULT_MAX_PAYLOAD, help="bytes per message")
    parser.add_argument("--jetstream-dir", default=None, help="enable JetStream, storing under this dir")


async def run_nats(args: argparse.Namespace) -> int:
    """Run an embedded nats-server until Ctrl-C."""
    config = NatsServerConfig(
        host=args.host, port=args.port, max_payload=args.max_payload, jetstream_store_dir=args.jetstream_dir
    )
    stop = shutdown_event()
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(NatsServer(config))
        print(server.url, flush=True)
        await stop.wait()
    return 0


# ---------------------------------------------------------------------------------------------
# specbus demo


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds allowed for each step")


async def run_demo(args: argparse.Namespace) -> int:
    """Start an embedded nats-server, round-trip a GenerateRequest through it, stop it.

    A micro service endpoint (bounded concurrency) decodes, and so validates, the request and
    answers it re-encoded, or with an Error; the client checks it got the same message back
    and that `$SRV.PING` finds the service.
    """
    sent = GenerateRequest(request_id="demo-1", prompt_token_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=8))
    payload = encode(sent)
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(NatsServer())
        print(f"started nats-server {server.url}")
        nc = await connect(server.url, "specbus-demo", initial_connect_timeout_s=args.timeout)
        stack.push_async_callback(nc.close)

        async def echo(req) -> None:
            try:
                await req.respond(encode(decode(req.data, GenerateRequest)))
            except SpecbusError as exc:
                await req.respond(error_reply(exc))

        echo_handler = BoundedHandler(echo, name="demo.echo", max_concurrency=2, max_pending=8)
        stack.push_async_callback(echo_handler.stop)
        service = await add_micro_service(
            nc, "specbus-demo", "0.1.0", "echoes GenerateRequests",
            endpoints={"echo": Endpoint(subject="specbus.demo.echo", handler=echo_handler.dispatch)},
        )
        stack.push_async_callback(service.stop)
        print("registered micro service specbus-demo, endpoint specbus.demo.echo")

        started = time.perf_counter()
        reply = await request(nc, "specbus.demo.echo", payload, deadline=time.time() + args.timeout)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        received = decode_any(reply.data)  # the GenerateRequest back, or an Error
        same = received == sent
        print(f"round-tripped a GenerateRequest ({len(payload)} bytes of msgpack) in {elapsed_ms:.2f} ms: "
              f"{'identical' if same else f'got {received!r}'}")
        ping = json.loads((await request(nc, "$SRV.PING.specbus-demo", b"", timeout_s=args.timeout)).data)
        print(f"$SRV.PING.specbus-demo answered by instance {ping['id']} (version {ping['version']})")
    print("stopped nats-server")
    return 0 if same else 1


# ---------------------------------------------------------------------------------------------
# entry point


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Awaitable[int]]


COMMANDS: dict[str, Command] = {
    "demo": Command("start nats-server, round-trip a schema message, stop", add_demo_arguments, run_demo),
    "nats": Command("run an embedded nats-server until Ctrl-C", add_nats_arguments, run_nats),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specbus", description="speculative-decoding LLM serving over NATS")
    parser.add_argument("--log-level", default="info", choices=sorted(LEVELS))
    parser.add_argument("--log-json", action="store_true", default=None, help="JSON logs (or SPECBUS_LOG_JSON=1)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(subparsers.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(json=args.log_json, level=args.log_level)
    return asyncio.run(COMMANDS[args.command].run(args))


if __name__ == "__main__":
    sys.exit(main())
