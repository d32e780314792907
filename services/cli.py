"""The `specbus` command. Subcommands live in COMMANDS (name -> Command); add one there.

Lifecycle of a long-running command: SIGINT/SIGTERM set an asyncio.Event, an
AsyncExitStack owns the server, connections and services, and unwinds them in reverse order.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import structlog

from text.tokenizer import load_tokenizer
from schemas.bus.codec import validate
from schemas.config import (DEFAULT_NATS_URL, ENV_PREFIX, MAX_MESSAGE_BYTES, NATS_PORT, ROLES, BusConfig,
                            default_target_model, load_config)
from schemas.draft_kinds import DRAFT_METHOD_CHOICES
from schemas.errors import CodecError, ErrorCode, SpecbusError
from schemas.generation import ChatMessage, GenerateRequest, SamplingParams, SpeculativeOptions, new_request_id
from schemas.streams import StreamChunk
from schemas.bus.subjects import DEFAULT_PREFIX
from services.client import Client
from services.commands import bench_serve
from services.commands.models import add_models_arguments, run_models
from services.commands.selfcheck import add_selfcheck_arguments, run_selfcheck_command
from services.launch.natsserver import NatsServer, NatsServerConfig
from services.launch.processes import PARENT_PID_ENV
from services.launch.supervisor import CrashLoop, supervise
from services.launch.up import add_stack_arguments, print_error, print_kernel_paths, stack_config, start_stack
from services.runtime.auth import users_from_env
from services.runtime.bus import cancel_tasks
from services.runtime.logs import LEVELS, configure_logging
from services.runtime.tasks import shutdown_event, until_stopped

log = structlog.get_logger(__name__)


# ---------------------------------------------------------------------------------------------
# specbus nats


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    parser.add_argument("--port", type=int, default=NATS_PORT,
                        help=f"client port; 0 picks a free one (default {NATS_PORT})")
    parser.add_argument("--max-payload", type=int, default=MAX_MESSAGE_BYTES, help="bytes per message")
    parser.add_argument("--jetstream-dir", default=None, help="enable JetStream, storing under this dir")
    parser.add_argument("--auth", action="store_true",
                        help="one user per role with subject permissions: users in SPECBUS_CLIENT_USERS, passwords "
                             "in SPECBUS_<USER>_NATS_PASSWORD (python -m services.runtime.auth credentials makes them)")


async def run_nats(args: argparse.Namespace) -> int:
    """Run an embedded nats-server until Ctrl-C."""
    users = ()
    if args.auth:
        try:
            users = tuple(users_from_env(prefix=os.environ.get(ENV_PREFIX + "PREFIX", DEFAULT_PREFIX)))
        except SpecbusError as exc:
            print_error(exc)
            return 2
    config = NatsServerConfig(
        host=args.host, port=args.port, max_payload=args.max_payload, jetstream_store_dir=args.jetstream_dir,
        users=users,
    )
    stop = shutdown_event()
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(NatsServer(config))
        print(server.url, flush=True)
        await stop.wait()
    return 0


# ---------------------------------------------------------------------------------------------
# specbus serve <role>

# role -> (module, function): imported only when that role runs, so `generate` never loads torch.
RUNNERS = {
    "scheduler": ("services.scheduler.scheduler", "run_scheduler"),
    "verifier": ("services.verifier.verifier", "run_verifier"),
    "drafter": ("services.drafter.drafter", "run_drafter"),
    "postprocessor": ("services.postprocessor.postprocessor", "run_postprocessor"),
    "gateway": ("services.gateway.gateway", "run_gateway"),
}
# Settings only the environment may give: a flag would show in `ps` and shell history.
ENV_ONLY_FIELDS = {"nats_password"}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-command per role, one flag per field of its config dataclass (--max-queue for
    max_queue, ...). A flag left out falls back to SPECBUS_<FIELD>, then to the default."""
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, config_cls in ROLES.items():
        role_parser = roles.add_parser(role, help=f"run one {role}", description=f"run one {role} until SIGINT/SIGTERM")
        for config_field in dataclasses.fields(config_cls):
            if config_field.name in ENV_ONLY_FIELDS:
                continue
            env_name = ENV_PREFIX + config_field.name.upper()
            default = (config_field.default if config_field.default_factory is dataclasses.MISSING
                       else config_field.default_factory())
            role_parser.add_argument(
                "--" + config_field.name.replace("_", "-"), dest=config_field.name, default=None,
                metavar=str(config_field.type).split(" ")[0].upper(),  # INT, FLOAT, STR
                help=f"default {default!r} (env {env_name})",
            )


def serve_config(args: argparse.Namespace):
    """The role's config from flags, env and defaults (SpecbusError naming a bad field)."""
    config_cls = ROLES[args.role]
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(config_cls)}
    return load_config(config_cls, **overrides)


async def stop_when_parent_exits(parent_pid: int, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Set stop once we are re-parented: the stack that started us died without stopping us."""
    while not stop.is_set():
        if os.getppid() != parent_pid:
            log.warning("parent_exited", parent_pid=parent_pid)
            stop.set()
            return
        await asyncio.sleep(interval_s)


async def run_serve(args: argparse.Namespace) -> int:
    """Run one service until SIGINT/SIGTERM: `run_<role>(config, stop)`."""
    try:
        config = serve_config(args)
    except SpecbusError as exc:
        print_error(exc)
        return 2
    module_name, function_name = RUNNERS[args.role]
    run_role = getattr(importlib.import_module(module_name), function_name)
    stop = shutdown_event()
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in ENV_ONLY_FIELDS}
    log.info("serve_starting", role=args.role, **settings)
    async with AsyncExitStack() as stack:
        parent_pid = os.environ.get(PARENT_PID_ENV)
        if parent_pid:
            watchdog = asyncio.create_task(stop_when_parent_exits(int(parent_pid), stop))
            stack.callback(watchdog.cancel)
        await run_role(config, stop)
    log.info("serve_stopped", role=args.role, instance_id=config.instance_id)
    return 0


# ---------------------------------------------------------------------------------------------
# specbus up


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=NATS_PORT,
                        help=f"NATS port on loopback; 0 picks a free one (default {NATS_PORT})")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="the OpenAI API on loopback; gateway i on PORT+i; 0 picks free ones (default 8000)")
    add_stack_arguments(parser)


async def run_up(args: argparse.Namespace) -> int:
    """Run the embedded stack until Ctrl-C, restarting a service process that exits
    (services/launch/supervisor.py); exit 1 when one role keeps crashing."""
    stop = shutdown_event()
    async with AsyncExitStack() as exit_stack:
        config = stack_config(args, args.port)
        stack = await start_stack(config, stop, exit_stack)
        if stack is None:
            return 0 if stop.is_set() else 1
        if config.verifiers:  # beside the supervision: a restart does not wait for it
            paths = asyncio.create_task(print_kernel_paths(config), name="kernel-paths")
            exit_stack.push_async_callback(cancel_tasks, [paths])
        try:
            await supervise(stack, stop)
        except CrashLoop as exc:
            print(f"error: {exc}\nstopping the stack", file=sys.stderr, flush=True)
            return 1
        print("stopping", flush=True)
        return 0


# ---------------------------------------------------------------------------------------------
# specbus generate

ANSI_DRAFT = "\x1b[32m"  # accepted draft tokens: green
ANSI_RESET = "\x1b[0m"


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help=f"NATS url (env SPECBUS_NATS_URL; default {DEFAULT_NATS_URL})")
    parser.add_argument("--prefix", default=None, help=f"subject prefix (env SPECBUS_PREFIX; default {DEFAULT_PREFIX!r})")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (with --chat: the user's message)")
    prompt.add_argument("--prompt-ids", type=int_list, help="prompt token ids, e.g. 1,2,3")
    parser.add_argument("--chat", action="store_true",
                        help="send --prompt as a user message: the target's chat template is applied and generation "
                             "stops at its end-of-turn token")
    parser.add_argument("--request-id", default=None, help="default: a fresh random id")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=None, help="0 with --prompt-logprobs scores the prompt")
    sampling.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeat for several)")
    sampling.add_argument("--stop-token-ids", type=int_list, default=None, help="e.g. 0,13 (the stop token is kept)")
    sampling.add_argument("--ignore-eos", action="store_true", default=None)
    sampling.add_argument("--presence-penalty", type=float, default=None)
    sampling.add_argument("--frequency-penalty", type=float, default=None)
    sampling.add_argument("--repetition-penalty", type=float, default=None, help="1 = off")
    sampling.add_argument("--logit-bias", type=bias_map, default=None, metavar="ID:BIAS,...",
                          help="added to these ids' logits, e.g. 13:-100,42:2.5")
    grammar = sampling.add_mutually_exclusive_group()  # docs/PROTOCOL.md#structured-outputs
    grammar.add_argument("--json-schema", default=None, metavar="SCHEMA",
                         help="the output is JSON following this schema (its text, or @FILE)")
    grammar.add_argument("--json-object", action="store_true", default=None, help="the output is a JSON object")
    grammar.add_argument("--regex", default=None, help="the output matches this regular expression")
    grammar.add_argument("--choice", action="append", default=None, help="the output is one of these (repeat)")
    grammar.add_argument("--grammar", default=None, metavar="LARK", help="the output follows this Lark grammar "
                                                                          "(its text, or @FILE)")
    speculative = parser.add_argument_group("speculative decoding")
    speculative.add_argument("--num-speculative-tokens", "-k", type=int, default=None, help="0 = plain decoding")
    speculative.add_argument("--draft-mode", choices=["greedy", "sample"], default=None)
    speculative.add_argument("--draft-method", choices=DRAFT_METHOD_CHOICES, default=None,
                             help="which drafters this request may use (default auto: whichever kind is live; with "
                                  "several, the better one for this request; and the scheduler's suffix index where "
                                  "it pays; suffix: that index alone)")
    speculative.add_argument("--coupling", choices=["rejection", "gumbel"], default=None,
                             help="how sampled drafts are accepted (default gumbel: a seeded sampled output independent of k and the "
                                  "draft; rejection: rejection sampling, every step at k)")
    logprobs = parser.add_argument_group("logprobs and masks")
    logprobs.add_argument("--logprobs", type=int, default=None, metavar="N", help="top-N logprobs per token (0: its own)")
    logprobs.add_argument("--logprobs-mode", choices=["raw", "processed"], default=None)
    logprobs.add_argument("--prompt-logprobs", type=int, default=None, metavar="N")
    logprobs.add_argument("--logprob-token-ids", type=int_list, default=None, help="logprobs of these ids everywhere")
    logprobs.add_argument("--sampling-mask", action="store_true", default=None, help="return each token's candidate set")
    logprobs.add_argument("--max-mask-size", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None, help="request timeout in seconds (default 60)")
    parser.add_argument("--json", action="store_true", help="print the final result as JSON instead of streaming text")
    parser.add_argument("--color", nargs="?", const="auto", default="never", choices=["auto", "always", "never"],
                        help="colour accepted draft tokens: auto = when stdout is a terminal")
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir for --color (default: the target model's)")


def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def bias_map(text: str) -> dict[int, float]:
    """ID:BIAS,... -> {id: bias} (OpenAI's logit_bias; the schema checks the values)."""
    try:
        return {int(key): float(value) for key, value in (part.split(":") for part in text.split(",") if part.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID:BIAS pairs separated by commas, got {text!r}") from None


def structured_outputs(args: argparse.Namespace) -> dict | None:
    """The request's structured_outputs from --json-schema / --json-object / --regex / --choice /
    --grammar (at most one; a value @FILE is read from FILE)."""
    def text(value: str) -> str:
        return Path(value[1:]).read_text() if value.startswith("@") else value
    if args.json_schema is not None:
        return {"json": text(args.json_schema)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    return None if args.grammar is None else {"grammar": text(args.grammar)}


def build_generate_request(args: argparse.Namespace) -> GenerateRequest:
    """The request from the flags; unset flags keep the schema's defaults. Raises CodecError
    (invalid_field) naming the bad field."""
    fields = {
        "sampling": {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
                     "top_p": args.top_p, "min_p": args.min_p, "seed": args.seed, "stop": args.stop,
                     "stop_token_ids": args.stop_token_ids, "ignore_eos": args.ignore_eos,
                     "coupling": args.coupling, "structured_outputs": structured_outputs(args),
                     "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
                     "repetition_penalty": args.repetition_penalty, "logit_bias": args.logit_bias},
        "speculative": {"num_speculative_tokens": args.num_speculative_tokens, "draft_mode": args.draft_mode,
                        "draft_method": args.draft_method},
        "logprobs": {"logprobs": args.logprobs, "logprobs_mode": args.logprobs_mode,
                     "prompt_logprobs": args.prompt_logprobs, "logprob_token_ids": args.logprob_token_ids,
                     "sampling_mask": args.sampling_mask, "max_mask_size": args.max_mask_size},
    }
    raw = {group: {k: v for k, v in values.items() if v is not None} for group, values in fields.items()}
    raw |= {"request_id": args.request_id or new_request_id(), "prompt_token_ids": args.prompt_ids}
    if args.chat and args.prompt is None:
        raise CodecError(ErrorCode.invalid_field, "--chat takes the user's message from --prompt, not --prompt-ids",
                         "messages")
    if args.chat:
        raw["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        raw["prompt"] = args.prompt
    if args.timeout is not None:
        raw["timeout_s"] = args.timeout
    return validate(GenerateRequest, raw)


def split_draft_text(tokenizer, completion_ids: list[int], chunk: StreamChunk) -> tuple[str, str]:
    """chunk.text as (text of its accepted draft tokens, the rest). Accepted drafts come first
    in a chunk; when their text cannot be told apart (a character split across tokens, a stop
    string cut) everything counts as the rest."""
    num_draft = sum(chunk.from_draft)
    if not num_draft:
        return "", chunk.text
    before = tokenizer.decode(completion_ids)
    with_drafts = tokenizer.decode([*completion_ids, *chunk.token_ids[:num_draft].tolist()])
    draft_text = with_drafts[len(before):]
    if not with_drafts.startswith(before) or not chunk.text.startswith(draft_text):
        return "", chunk.text
    return draft_text, chunk.text[len(draft_text):]


def wants_color(when: str) -> bool:
    return when == "always" or (when == "auto" and sys.stdout.isatty())


async def run_generate(args: argparse.Namespace) -> int:
    """Stream the completion's text to stdout (or print the final result with --json)."""
    tokenizer = None
    if wants_color(args.color) and not args.json:
        tokenizer = load_tokenizer(args.tokenizer or os.environ.get(ENV_PREFIX + "TOKENIZER", default_target_model()))
    try:
        request = build_generate_request(args)
        # url, prefix, credentials and TLS files: flags, then the SPECBUS_* variables the services read
        bus = load_config(BusConfig, nats_url=args.url, prefix=args.prefix)
        async with Client.from_config(bus) as client:
            if args.json:
                result = await client.generate(request)
                print(json.dumps(result.to_json()), flush=True)
                return 0
            completion_ids: list[int] = []
            async for chunk in client.stream(request):
                if tokenizer is None:
                    sys.stdout.write(chunk.text)
                else:
                    draft_text, rest = split_draft_text(tokenizer, completion_ids, chunk)
                    sys.stdout.write(f"{ANSI_DRAFT}{draft_text}{ANSI_RESET}{rest}" if draft_text else rest)
                    completion_ids += chunk.token_ids.tolist()
                sys.stdout.flush()
            print(flush=True)
            return 0
    except SpecbusError as exc:
        print_error(exc)
        return 1


# ---------------------------------------------------------------------------------------------
# specbus demo

# Questions for a target with a chat template (SmolLM2), sent as chat messages.
DEMO_QUESTIONS = (
    "What is the capital of France?",
    "What is 2 plus 2?",
    "Write a Python function that returns the square of a number.",
)
# For a target without one (the tiny pair): openings of Python standard-library-like code.
DEMO_PROMPTS = (
    'import os\nimport sys\n\n\ndef main(argv=None):\n    """',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n",
)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=0, help="NATS port on loopback (default 0: a free one)")
    add_stack_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per generation")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per generation")


@dataclass
class DemoRun:
    name: str
    speculative: SpeculativeOptions
    sampling: SamplingParams
    results: list = dataclasses.field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> str:
        usages = [r.usage for r in self.results]
        completion = sum(u.completion_tokens for u in usages)
        proposed = sum(u.draft_tokens_proposed for u in usages)
        accepted = sum(u.draft_tokens_accepted for u in usages)
        steps = sum(u.steps for u in usages)
        acceptance = f"{accepted / proposed:.2f}" if proposed else "-"
        return (f"{self.name:<22} {completion:>6} tokens {completion / max(self.wall_s, 1e-9):>8.1f} tokens/s   "
                f"acceptance {acceptance:>4}   tokens/step {completion / max(steps, 1):.2f}")


def demo_runs(max_tokens: int) -> list[DemoRun]:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=max_tokens)
    return [
        DemoRun("greedy, k=0 (plain)", SpeculativeOptions(num_speculative_tokens=0), greedy),
        DemoRun("greedy, k=4", SpeculativeOptions(num_speculative_tokens=4), greedy),
        DemoRun("sampled, k=4, seed", SpeculativeOptions(num_speculative_tokens=4, draft_mode="sample"), sampled),
    ]


async def generate_demo_runs(client: Client, runs: list[DemoRun], timeout_s: float, chat: bool) -> None:
    """Each run over every demo question (chat) or prompt, one request at a time, printing each answer."""
    for run in runs:
        for index, prompt in enumerate(DEMO_QUESTIONS if chat else DEMO_PROMPTS):
            text = {"messages": [ChatMessage(role="user", content=prompt)]} if chat else {"prompt": prompt}
            request = GenerateRequest(request_id=f"demo-{new_request_id()}", **text, sampling=run.sampling,
                                      speculative=run.speculative, timeout_s=timeout_s)
            started = time.perf_counter()
            result = await client.generate(request)
            run.wall_s += time.perf_counter() - started
            run.results.append(result)
            shown = f"Q: {prompt}\nA: {result.text.strip()}" if chat else prompt + result.text
            print(f"--- {run.name} | prompt {index} | {result.finish_reason}\n{shown}\n", flush=True)


async def run_demo(args: argparse.Namespace) -> int:
    """`up` on a free port, a few generations (greedy k=0 and k=4, one sampled), a summary of
    speed and acceptance, then a clean shutdown. Exit 1 when greedy k=4 differs from k=0.
    A target with a chat template is asked DEMO_QUESTIONS as a chat, any other continues
    DEMO_PROMPTS."""
    stop = shutdown_event()
    runs = demo_runs(args.max_tokens)
    config = stack_config(args, args.port)
    async with AsyncExitStack() as exit_stack:
        stack = await start_stack(config, stop, exit_stack)
        if stack is None:
            return 1
        chat = load_tokenizer(config.target_model or default_target_model()).chat_template is not None
        client = await exit_stack.enter_async_context(stack.client())
        try:
            if not await until_stopped(generate_demo_runs(client, runs, args.timeout, chat), stop):
                return 1
        except SpecbusError as exc:
            print_error(exc)
            return 1
    print("summary (one request at a time):")
    for run in runs:
        print("  " + run.summary())
    same = [a.token_ids == b.token_ids for a, b in zip(runs[0].results, runs[1].results)]
    print(f"greedy k=4 vs k=0: {'identical' if all(same) else 'DIFFERENT'} on {sum(same)}/{len(same)} prompts")
    print("stopped", flush=True)
    return 0 if all(same) else 1


# ---------------------------------------------------------------------------------------------
# entry point


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Awaitable[int]]


# ---------------------------------------------------------------------------------------------
# specbus bench


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    bench_serve.add_arguments(benches.add_parser("serve", help=bench_serve.HELP, description=bench_serve.HELP))


async def run_bench(args: argparse.Namespace) -> int:
    return await bench_serve.run(args)  # "serve" is the only benchmark so far


COMMANDS: dict[str, Command] = {
    "up": Command("run nats-server and every service (each a process) until Ctrl-C", add_up_arguments, run_up),
    "serve": Command("run one service (scheduler, verifier, drafter, postprocessor or gateway)", add_serve_arguments,
                     run_serve),
    "generate": Command("send one generate request; stream its text (or --json)", add_generate_arguments,
                        run_generate),
    "demo": Command("up on a free port, a few generations, a speed/acceptance summary, stop", add_demo_arguments,
                    run_demo),
    "nats": Command("run an embedded nats-server until Ctrl-C", add_nats_arguments, run_nats),
    "selfcheck": Command("check a running stack: speculation must change nothing (exit 1 on a failure)",
                         add_selfcheck_arguments, run_selfcheck_command),
    "models": Command("pull the default target model, or list the known models", add_models_arguments, run_models),
    "bench": Command("benchmarks; `bench serve` load-tests an OpenAI-compatible server (ShareGPT or random prompts)",
                     add_bench_arguments, run_bench),
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
