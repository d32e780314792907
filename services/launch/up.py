"""The embedded stack as the commands start it (`specbus up`, `demo`, `selfcheck --local`): the
stack flags, the StackConfig they give, and a start that prints the URL, a ready line and where
the credentials are, or the error, and gives up when Ctrl-C comes first; `specbus up` then prints
the verifiers' kernel paths (`print_kernel_paths`)."""

import argparse
import asyncio
import dataclasses
import os
import sys
from contextlib import AsyncExitStack

from text.tokenizer import draft_misfit, eagle_misfit
from schemas.config import ENV_PREFIX, ROLES, DrafterConfig, check_model_dir, default_target_model
from schemas.draft_kinds import DEFAULT_DRAFT_METHOD, DRAFT_KINDS, DRAFT_METHODS, DraftKind
from schemas.errors import ErrorCode, SpecbusError
from schemas.bus.subjects import DEFAULT_PREFIX
from services.launch.natsserver import NatsServerConfig, NatsServerError
from services.launch.processes import StackError
from services.launch.stack import Stack, StackConfig
from services.runtime.auth import CLIENT
from services.runtime.tasks import until_stopped

KERNEL_PATHS_TIMEOUT_S = 300.0  # a torch import and the kernel's load (built by then) on a busy machine


def print_error(exc: SpecbusError) -> None:
    where = f" (field: {exc.field})" if exc.field else ""
    print(f"error: {exc.code.value}: {exc.message}{where}", file=sys.stderr)


# Why a drafter's model cannot serve the target, by its kind's DraftKind.fits (schemas/draft_kinds.py).
MISFITS = {"tokenizer": draft_misfit, "target": eagle_misfit}


def check_drafter_model(config: StackConfig, kind: DraftKind, target: str) -> None:
    """SpecbusError naming the setting when the directory a drafter of kind loads is missing or
    does not serve the target: a kind that reads the target (fits "target") needs the target's
    directory too and is checked against it always; one that fits by tokenizer is checked
    against the verifiers' target when the stack has verifiers."""
    default = next(f.default for f in dataclasses.fields(DrafterConfig) if f.name == kind.model_setting)
    model_dir = getattr(config, kind.model_setting) or default
    check_model_dir(model_dir, kind.model_setting)
    if kind.fits == "target":
        check_model_dir(target, "target_model")  # the head reads its embedding
    elif not config.verifiers:
        return
    misfit = MISFITS[kind.fits](target, model_dir)
    if misfit is not None:
        raise SpecbusError(ErrorCode.invalid_field, misfit, kind.model_setting)


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", default=None, help=f"subject prefix (default {DEFAULT_PREFIX!r}, env SPECBUS_PREFIX)")
    parser.add_argument("--target-model", default=None,
                        help="HF-layout target dir (env SPECBUS_TARGET_MODEL; default: SmolLM2-135M-Instruct as "
                             "`specbus models pull` puts it in $SPECBUS_HOME)")
    parser.add_argument("--draft-model", default=None,
                        help="HF-layout draft dir (env SPECBUS_DRAFT_MODEL; default: models/smollm2-draft)")
    parser.add_argument("--draft-method", default=None, choices=DRAFT_METHODS,
                        help="the drafters' method (env SPECBUS_DRAFT_METHOD; default model: --draft-model; ngram: "
                             "prompt lookup in the request's own text, no model, fits any target; eagle: --eagle-head "
                             "over the target's own features, fits the target it was trained for)")
    parser.add_argument("--eagle-head", default=None,
                        help="EAGLE head dir for --draft-method eagle (env SPECBUS_EAGLE_HEAD; default: "
                             "models/smollm2-eagle, for the default target)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                        help="verifier and drafter weights and KV cache (env SPECBUS_DTYPE; default auto: float32 "
                             "for a target with GGUF blocks on a CPU with the projection kernel, its published "
                             "weights; else bfloat16 on CUDA and on CPUs with native bf16, else float32)")
    parser.add_argument("--weights", default=None, choices=["auto", "dense", "gguf", "int8", "int8dot"],
                        help="how the verifier holds the target's projections (env SPECBUS_WEIGHTS; default auto: "
                             "the GGUF blocks as published where the model has them: under dtype auto by int8 "
                             "activation blocks and integer dot products (int8dot, llama.cpp's model of the file), "
                             "under dtype float32 widened to float32 (gguf, bit for bit the float32 model); else "
                             "dense; int8: weight-only int8, the dense weights "
                             "quantized to Q8_0 blocks at load, float32 activations, a changed model)")
    parser.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                        help="each verifier's and drafter's KV cache budget, e.g. 2GiB, 512MiB (env "
                             "SPECBUS_KV_CACHE_MEMORY; default 2GiB): slots take memory as their tokens need it, "
                             "and a request the budget cannot hold is refused `overloaded`")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="the verifiers and drafters compute every prompt token (env SPECBUS_PREFIX_CACHING=false; default: "
                             "they keep finished requests' keys and values within --kv-cache-memory and reuse them "
                             "for histories that start the same, per client user, with the same output bits)")
    for role in ("verifier", "drafter"):
        parser.add_argument(f"--{role}-threads", type=int, default=0, metavar="N",
                            help=f"torch threads per {role} (default 0: from the machine's cores, see "
                                 f"docs/PERFORMANCE.md, 'Threads and memory')")
    for role in ROLES:
        parser.add_argument(f"--{role}s", type=int, default=1, metavar="N", help=f"{role} processes (default 1)")
    parser.add_argument("--log-dir", default=None, help="keep each service's log here (default: a temp dir)")
    parser.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                        help="nats-servers joined as a cluster on loopback (default 1: one server); every service "
                             "gets every node's URL and moves to another node when its own dies")
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds for every service to heartbeat")
    parser.add_argument("--clients", default=CLIENT, metavar="NAMES",
                        help="NATS client users, comma-separated (default 'client'): each may read and cancel only "
                             "its own requests; each login in <log-dir>/client-<name>.env")
    parser.add_argument("--no-auth", action="store_true",
                        help="no NATS users, and the gateways accept any API key (default: one user per role, "
                             "random passwords and API keys written to the log dir)")
    parser.add_argument("--metrics-port-base", type=int, default=0, metavar="PORT",
                        help="serve each instance's Prometheus /metrics on PORT, PORT+1, ... (default 0: none)")


def stack_config(args: argparse.Namespace, port: int) -> StackConfig:
    """Model dirs are passed on only when given: the children read SPECBUS_* themselves."""
    return StackConfig(
        **{f"{role}s": getattr(args, f"{role}s") for role in ROLES},
        # from the environment too, so the scheduler and postprocessor get the target's tokenizer
        target_model=args.target_model or os.environ.get(ENV_PREFIX + "TARGET_MODEL"),
        draft_model=args.draft_model or os.environ.get(ENV_PREFIX + "DRAFT_MODEL"),
        draft_method=args.draft_method or os.environ.get(ENV_PREFIX + "DRAFT_METHOD"),
        eagle_head=args.eagle_head or os.environ.get(ENV_PREFIX + "EAGLE_HEAD"),
        dtype=args.dtype,
        weights=args.weights,
        kv_cache_memory=args.kv_cache_memory,
        prefix_caching=False if args.no_prefix_caching else None,
        verifier_threads=args.verifier_threads,
        drafter_threads=args.drafter_threads,
        prefix=args.prefix or os.environ.get(ENV_PREFIX + "PREFIX", DEFAULT_PREFIX),
        nats=NatsServerConfig(port=port),
        nats_cluster=args.nats_cluster,
        log_dir=args.log_dir,
        log_level=args.log_level,
        ready_timeout_s=args.ready_timeout,
        auth=not args.no_auth,
        client_users=tuple(name.strip() for name in args.clients.split(",") if name.strip()),
        metrics_port_base=args.metrics_port_base,
        http_port=getattr(args, "http_port", 0),  # `demo`: free ports
    )


async def start_stack(config: StackConfig, stop: asyncio.Event, exit_stack: AsyncExitStack) -> Stack | None:
    """Start server and services, printing the URL then a ready line. None when Ctrl-C came
    first or a part failed to start (its error printed)."""
    try:  # a missing model dir fails here, naming it, rather than in each child's log
        if config.verifiers or config.schedulers or config.postprocessors:
            check_model_dir(config.target_model or default_target_model(), "target_model")
        kind = DRAFT_KINDS.get(config.draft_method or DEFAULT_DRAFT_METHOD)  # an unknown one fails in the drafters
        if config.drafters and kind is not None and kind.model_setting is not None:
            check_drafter_model(config, kind, config.target_model or default_target_model())
    except SpecbusError as exc:
        print_error(exc)
        return None
    stack = Stack(config)
    exit_stack.push_async_callback(stack.stop)
    try:
        if not await until_stopped(stack.start_server(), stop):
            return None
        print(stack.url, flush=True)
        if not await until_stopped(stack.start_services(), stop):
            return None
    except (StackError, NatsServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    counts = ", ".join(f"{config.count(role)} {role}" for role in ROLES if role != "gateway")
    # which model of the target the verifiers compute (their heartbeats' weights: int8dot, gguf, ...)
    weights = sorted({b.model_ids.get("weights", "") for b in stack.heartbeats.values() if b.role == "verifier"} - {""})
    served = f", target weights {','.join(weights)}" if weights else ""
    print(f"ready: {counts} on {stack.url} (prefix {config.prefix!r}{served}, logs in {stack.log_dir})", flush=True)
    if stack.credentials_path:
        print(f"credentials: {stack.client_env_path} (client user {stack.client_login()['user']!r}: "
              f"`set -a; . {stack.client_env_path}; set +a` before `specbus generate`, which then finds the "
              f"server too (SPECBUS_NATS_URL); every user's password "
              f"in {stack.credentials_path})", flush=True)
    if stack.gateway_ports:
        print(f"openai: {config.gateways} gateway(s), the first on {stack.openai_base_url} (OPENAI_BASE_URL and "
              f"OPENAI_API_KEY in {stack.client_env_path})", flush=True)
    return stack


async def print_kernel_paths(config: StackConfig) -> None:
    """Print which path each op runs in the stack's verifiers (gpu_worker/runtime/kernel_paths.py:
    the report the verifier logs, for the same settings), from a subprocess: this process never
    imports torch. A report that cannot be made is a line saying so; the stack runs on."""
    args = [f"--{name.replace('_', '-')}={value}" for name in ("target_model", "dtype", "weights")
            if (value := getattr(config, name)) is not None]
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.verifier.verifier", "kernel-paths", *args,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), KERNEL_PATHS_TIMEOUT_S)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        process.kill()
        await process.wait()
        raise
    text = out.decode().rstrip() if process.returncode == 0 else f"kernel paths: not known ({err.decode()[-300:]})"
    print(text, flush=True)
