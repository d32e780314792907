"""Configuration of every service, in one place.

Each service has a dataclass; `load_config(cls, **overrides)` fills it from, in order of
precedence: explicit overrides (CLI flags, tests), environment variables `SPECBUS_<FIELD>`
(read when called, never at import), then the defaults below. Unknown override names and values
that do not parse are a `SpecbusError` naming the field.

Timeouts are seconds. Defaults are sized for the shipped CPU model pair on loopback NATS.
"""

import dataclasses
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Mapping, TypeVar

from schemas.draft_kinds import DEFAULT_DRAFT_METHOD, DRAFT_METHODS
from schemas.errors import ErrorCode, SpecbusError
from schemas.bus.protocol import MAX_TREE_NODES
from schemas.bus.subjects import DEFAULT_PREFIX, check_instance_id

REPO_MODELS = Path(__file__).resolve().parent.parent / "models"
ENV_PREFIX = "SPECBUS_"
# The 4.7M-parameter pair in git: fast tests pass it explicitly (models/README.md).
TINY_TARGET = REPO_MODELS / "tiny" / "target"
TINY_DRAFT = REPO_MODELS / "tiny" / "draft"
# The default pair: SmolLM2-135M-Instruct, converted into $SPECBUS_HOME by `specbus models pull`,
# and the draft distilled from it, shipped in git.
DEFAULT_TARGET_NAME = "smollm2-135m-instruct"
DEFAULT_DRAFT = REPO_MODELS / "smollm2-draft"
# The EAGLE head trained on the default target's features (models/README.md), shipped in git.
DEFAULT_EAGLE_HEAD = REPO_MODELS / "smollm2-eagle"
# One owner each, imported wherever the value is needed (never written again as a literal):
NATS_PORT = 4222                      # nats-server's client port, the default of every URL and flag
DEFAULT_NATS_URL = f"nats://127.0.0.1:{NATS_PORT}"
MAX_MESSAGE_BYTES = 8 * 1024 * 1024   # a service's NATS max_payload, the codec's and the HTTP body's cap
FINISHED_ID_TTL_S = 60.0              # a finished request id stays known (refused, commits dropped) this long
CLIENT_ENV_FILE = "client.env"        # what `specbus up --log-dir DIR` writes for clients, in DIR
GGUF_BLOCKS_FILE = "gguf/blocks.safetensors"  # in a pulled model dir: its GGUF weights as stored (gguf_convert.py)
HEARTBEAT_TIMEOUT_S = 2.0             # silence after which an instance (or a scheduler, to a client) is dead


def service_version() -> str:
    """The installed package's version (pyproject.toml), as every service reports it on $SRV.INFO."""
    import importlib.metadata

    try:
        return importlib.metadata.version("specbus")
    except importlib.metadata.PackageNotFoundError:  # a source tree run without installing
        return "0.0.0"


def specbus_home() -> Path:
    """$SPECBUS_HOME (read when called), default ~/.cache/specbus: where pulled models live."""
    return Path(os.environ.get(ENV_PREFIX + "HOME") or Path.home() / ".cache" / "specbus")


def default_target_model() -> str:
    return str(specbus_home() / "models" / DEFAULT_TARGET_NAME)


def check_model_dir(path, field: str) -> None:
    """SpecbusError naming field when path is not a directory, saying how to get the default ones."""
    path = Path(path)
    if path.is_dir():
        return
    if path == Path(default_target_model()):
        hint = "run `specbus models pull` to fetch and convert it"
    elif path == DEFAULT_DRAFT:
        hint = "it ships in the repository (ops/train/distill_draft.py makes it); check out models/ in full"
    elif path == DEFAULT_EAGLE_HEAD:
        hint = "it ships in the repository (ops/train/train_eagle.py makes it); check out models/ in full"
    else:
        hint = "give an HF-layout directory (config.json, *.safetensors, tokenizer.json)"
    raise SpecbusError(ErrorCode.invalid_field, f"{field}: model directory {path} does not exist; {hint}", field)


def default_instance_id(role: str) -> str:
    """A fresh id per process: role, host and a random suffix (ids are subject tokens)."""
    host = "".join(c if c.isalnum() else "-" for c in socket.gethostname())[:24]
    return f"{role}-{host}-{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass
class BusConfig:
    """How to reach NATS. Credentials come from the environment or flags, never defaults."""

    nats_url: str = DEFAULT_NATS_URL
    prefix: str = DEFAULT_PREFIX
    nats_user: str | None = None
    nats_password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout_s: float = 5.0


@dataclasses.dataclass
class InstanceConfig(BusConfig):
    instance_id: str = ""  # empty: default_instance_id(role) at load time
    heartbeat_interval_s: float = 0.5
    metrics_port: int = 0  # 0 = no Prometheus endpoint


@dataclasses.dataclass
class SchedulerConfig(InstanceConfig):
    max_queue: int = 64  # admitted but not yet running; beyond it: `overloaded`
    max_running: int = 64  # requests decoding at once
    # Shares of max_running + max_queue between client users, "alice=2,bob=1" (a user not listed
    # weighs 1); services/scheduler/budget/fair_share.py says how they are applied.
    user_weights: str = ""
    # Client users whose requests share one prefix cache on the verifiers, "alice,bob", or "*" for
    # every user; the others each have their own (a hit's timing would tell one what another
    # sent). docs/PROTOCOL.md#prefix-caching.
    prefix_cache_shared_users: str = ""
    max_batch_rows: int = 64  # rows in one step's batch per verifier
    max_step_tokens: int = 1024  # new tokens per verifier per step at most (prefill is chunked to fit)
    # The time a step's verify batch aims at, at the verifier: every decoding row first, then
    # prefill chunks up to the tokens the verifier's measured pace fits in this time (its step
    # budget, services/scheduler/budget/step_budget.py), so a long prompt never stalls the rows decoding;
    # and queued requests start only while the running ones' decode rows fill at most half of it
    # (step rows): under load, the inter-token latency the scheduler aims at. Lower trades
    # throughput for ITL, where a step's fixed costs (drafts, bus, commit) are a large part of it
    # (ops/bench/RESULTS.md "Serving under load" has what 0.3 kept of a burst's decoding rows' ITL
    # and the throughput it cost).
    target_step_s: float = 0.3
    # Step loops, each with its own share of the running requests, so one lane's drafting overlaps
    # another's verification (services/scheduler/scheduler_core.py); 1: one step at a time. max_batch_rows and
    # max_step_tokens hold per lane. Two pay only where the drafter and the verifier have compute of
    # their own (a GPU each, a GPU verifier beside a CPU drafter); on shared CPU cores they split the
    # cores and each lane's batch: 1 (ops/bench/RESULTS.md "Lanes on shared cores").
    lanes: int = 1
    max_tokens_cap: int = 4096
    draft_timeout_s: float = 0.5
    # The least a verify try is waited for; a batch's own wait follows its tokens and the
    # verifier's measured pace, and a verifier that still heartbeats is waited on past it
    # (services/scheduler/budget/step_budget.py).
    verify_timeout_s: float = 10.0
    verify_retries: int = 1
    # On stop, how long the step in flight may still run before it is cancelled (its requests
    # then end with "error" like every other); kept under the stack's SIGKILL stop_timeout_s.
    stop_grace_s: float = 5.0
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    # A request's num_speculative_tokens is an upper bound: each step of a greedy or Gumbel-coupled
    # row takes the k that maximises its measured tokens per second (services/scheduler/drafts/adaptive_k.py);
    # false: every step takes the request's k. After adaptive_k_probe_steps steps at k=0 of a
    # drafter's requests, one tries k=1 (twice as many after each probe that had nothing accepted,
    # at most 8 times as many).
    adaptive_k: bool = True
    adaptive_k_probe_steps: int = 16
    # Trees of drafts (docs/PROTOCOL.md#tree-drafts): 0, chains only; N > 0 lets a greedy or
    # Gumbel-coupled decode row without structured outputs ask its drafter for a tree of N nodes
    # (or N/2, N/4, ... while those still branch), as deep as its k, in the steps where its measured
    # tokens per second beat the chain's (services/scheduler/drafts/tree_choice.py; with adaptive_k off, N
    # in every such step). Off by default: a tree verifies a target position per node, and on the
    # CPUs measured its extra accepted tokens paid for that at best evenly at batch 1
    # (docs/PROTOCOL.md#tree-drafts).
    max_tree_nodes: int = 0
    # Suffix decoding (services/scheduler/drafts/suffix_index.py, suffix_choice.py): this scheduler indexes
    # every request's prompt and output, per client user, in at most suffix_max_tokens tokens per
    # user (least recently used requests out), and a greedy or Gumbel-coupled row takes the index's
    # drafts in the steps where they are expected to pay more than its drafter's; 0: off.
    # suffix_shared: one index for all users, off by default: a draft drawn from another user's
    # requests makes this one's tokens come faster when the other sent the same, which tells what
    # the other sent (as a shared prefix cache would).
    suffix_max_tokens: int = 65536
    suffix_shared: bool = False
    # the verifiers' tokenizer: text prompts, chat templates, EOS ids
    tokenizer: str = dataclasses.field(default_factory=default_target_model)

    def __post_init__(self) -> None:
        if not self.target_step_s > 0:
            raise SpecbusError(ErrorCode.invalid_field, f"target_step_s: {self.target_step_s} is not > 0",
                               "target_step_s")


@dataclasses.dataclass
class ModelServiceConfig(InstanceConfig):
    """What the verifier and the drafter share: a model, its KV cache slots, torch threads."""

    device: str = "cpu"
    # auto: float32 where the model has GGUF blocks the CPU's projection kernel serves (weights auto
    # or gguf: the published weights as stored), else bfloat16 on CUDA and on CPUs with native
    # bf16, else float32 (a drafter: bfloat16); gpu_worker/batching/slots.py resolve_dtype
    dtype: str = "auto"
    # How the projection weights are held: "dense" (the safetensors weights, in dtype); "gguf" (the
    # GGUF blocks `specbus models pull` keeps beside them, the published Q4_1 / Q8_0 weights as
    # stored, with float32 activations: bit for bit the dense float32 model,
    # gpu_worker/runtime/quantized.py); "int8": weight-only int8, the dense weights quantized to
    # Q8_0 blocks at load (float32 activations; a changed model); "int8dot": the GGUF blocks by int8
    # activation blocks and integer dot products (llama.cpp's model of the file, not the float32
    # one); "auto": the GGUF blocks where the model directory has them and float32 runs on a CPU
    # where the projection kernel runs (int8dot under dtype auto, gguf under dtype float32), else dense.
    weights: str = "auto"
    max_slots: int = 64
    max_seq_len: int = 2048
    prefill_chunk: int = 512  # tokens per forward for a long prompt
    slot_idle_ttl_s: float = 300.0  # a slot untouched this long is freed (its scheduler is gone)
    # torch intra-op threads; 0 leaves torch's default (one per core). `specbus up` sets it per
    # role from the machine (services/launch/stack.py role_threads).
    torch_threads: int = 0
    # The KV cache's memory budget ("2GiB", "512MiB", "1.5GB", or bytes; parse_bytes): slots get
    # storage as their tokens need it, within this (gpu_worker/runtime/kv_cache.py). 2 GiB holds ~46k
    # tokens of SmolLM2-135M in float32 (92k in bfloat16): 64 requests of ~700 tokens, and keeps a
    # few stacks inside a 24 GB machine.
    kv_cache_memory: str = "2GiB"
    # Keep released slots' keys and values within kv_cache_memory and copy them into requests whose
    # history starts the same (gpu_worker/batching/prefix_cache.py; a drafter with draft_method "model"
    # only); a hit computes the same bits.
    prefix_caching: bool = True


@dataclasses.dataclass
class VerifierConfig(ModelServiceConfig):
    target_model: str = dataclasses.field(default_factory=default_target_model)


@dataclasses.dataclass
class DrafterConfig(ModelServiceConfig):
    draft_model: str = str(DEFAULT_DRAFT)
    # "model": drafts from draft_model; "ngram": prompt lookup, no model (gpu_worker/drafter/ngram.py),
    # drafts continue the longest n-gram (ngram_max down to ngram_min tokens) seen before in the
    # request's own history; it fits every target; "eagle": the EAGLE head in eagle_head over the
    # target's own features (gpu_worker/drafter/eagle_drafter.py), with target_model's embedding; it fits
    # that target only.
    draft_method: str = DEFAULT_DRAFT_METHOD  # a kind of schemas/draft_kinds.py DRAFT_METHODS
    ngram_max: int = 4
    ngram_min: int = 1
    eagle_head: str = str(DEFAULT_EAGLE_HEAD)
    target_model: str = dataclasses.field(default_factory=default_target_model)

    def __post_init__(self) -> None:
        if self.draft_method not in DRAFT_METHODS:
            raise SpecbusError(ErrorCode.invalid_field, f"draft_method: {self.draft_method!r} is not one of "
                                                        f"{list(DRAFT_METHODS)}", "draft_method")


@dataclasses.dataclass
class PostprocessorConfig(InstanceConfig):
    tokenizer: str = dataclasses.field(default_factory=default_target_model)  # a dir holding tokenizer.json
    side_channel_timeout_s: float = 2.0
    max_requests: int = 1024


@dataclasses.dataclass
class GatewayConfig(BusConfig):
    """The OpenAI-compatible HTTP gateway (services/gateway/gateway.py). It logs in to NATS as the
    client users (SPECBUS_CLIENT_USERS, their passwords, their API keys SPECBUS_<USER>_API_KEY)
    and as "monitor" for /health; no_auth: any API key, one connection with nats_user/_password."""

    instance_id: str = ""  # empty: default_instance_id(role) at load time
    metrics_port: int = 0  # 0 = none besides GET /metrics on the HTTP port
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    no_auth: bool = False
    # the model id, tokenizer and chat template
    target_model: str = dataclasses.field(default_factory=default_target_model)
    draft_model: str = str(DEFAULT_DRAFT)  # listed in /v1/models
    served_model_name: str = ""  # empty: the target dir's name
    default_max_tokens: int = 256  # a chat request without max_tokens (completions: 16, as OpenAI)
    timeout_s: float = 600.0  # per request unless the body gives timeout_s
    health_timeout_s: float = 2.0  # for a scheduler to answer $SRV.PING
    # Limits checked before any work (docs/HTTP_API.md#limits): the API key before the
    # body is read, then the body's size and pace. A prompt of MAX_PROMPT_CHARS characters (the most
    # a GenerateRequest takes) is at most 6 MiB of JSON even with every character \u-escaped, so
    # the largest valid request fits max_body_bytes; larger is a 413 before it is read.
    max_body_bytes: int = MAX_MESSAGE_BYTES
    body_timeout_s: float = 30.0  # to receive the whole body (a slow body is a 408), ~280 KB/s for the largest
    header_timeout_s: float = 10.0  # from a connection's first byte (or an idle one's) to its request's headers
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this (uvicorn's default)
    max_header_bytes: int = 16 * 1024  # request line and headers; larger is a 400 (h11's default)


ROLES: dict[str, type] = {
    "scheduler": SchedulerConfig,
    "verifier": VerifierConfig,
    "drafter": DrafterConfig,
    "postprocessor": PostprocessorConfig,
    "gateway": GatewayConfig,
}

C = TypeVar("C")

BYTE_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
              "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str, field: str) -> int:
    """A size like "2GiB", "512MiB", "1.5GB", "2G" (binary, as docker reads it) or "1073741824" ->
    bytes; SpecbusError naming field for anything else or a size that is not positive."""
    raw = str(text).strip()
    number = raw.rstrip("BbIiKkMmGgTt ")
    unit = raw[len(number):].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = None
    if value is None or unit not in BYTE_UNITS or value * BYTE_UNITS[unit] < 1:
        raise SpecbusError(ErrorCode.invalid_field, f"{field}: {raw!r} is not a positive size like '2GiB', "
                           f"'512MiB', '1.5GB' or a number of bytes", field)
    return int(value * BYTE_UNITS[unit])


def _parse(field: dataclasses.Field, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    if "None" in kind and raw == "":
        return None
    if kind.startswith("int"):
        return int(raw)
    if kind.startswith("float"):
        return float(raw)
    if kind.startswith("bool"):
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"{raw!r} is not a boolean")
        return raw.lower() in ("1", "true", "yes")
    return raw


def load_config(cls: type[C], env: Mapping[str, str] | None = None, **overrides: Any) -> C:
    """cls filled from overrides (None values ignored), then SPECBUS_<FIELD> env vars, then defaults."""
    env = os.environ if env is None else env
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(overrides) - set(fields)
    if unknown:
        raise SpecbusError(ErrorCode.invalid_field, f"unknown setting {sorted(unknown)[0]!r}", sorted(unknown)[0])
    values = {}
    for name, field in fields.items():
        raw = overrides.get(name)
        if raw is None:
            raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        try:
            values[name] = _parse(field, raw)
        except ValueError as exc:
            raise SpecbusError(ErrorCode.invalid_field, f"{name}: {exc}", name) from None
    config = cls(**values)
    if hasattr(config, "kv_cache_memory"):
        parse_bytes(config.kv_cache_memory, "kv_cache_memory")
    if getattr(config, "lanes", 1) < 1:
        raise SpecbusError(ErrorCode.invalid_field, f"lanes: {config.lanes} is not at least 1", "lanes")
    if getattr(config, "adaptive_k_probe_steps", 1) < 1:
        raise SpecbusError(ErrorCode.invalid_field, f"adaptive_k_probe_steps: {config.adaptive_k_probe_steps} is not "
                                                    f"at least 1", "adaptive_k_probe_steps")
    if getattr(config, "suffix_max_tokens", 0) < 0:
        raise SpecbusError(ErrorCode.invalid_field, f"suffix_max_tokens: {config.suffix_max_tokens} is negative",
                           "suffix_max_tokens")
    if not 0 <= getattr(config, "max_tree_nodes", 0) <= MAX_TREE_NODES:
        raise SpecbusError(ErrorCode.invalid_field, f"max_tree_nodes: {config.max_tree_nodes} is not in [0, "
                                                    f"{MAX_TREE_NODES}]", "max_tree_nodes")
    if hasattr(config, "instance_id"):
        role = next((r for r, c in ROLES.items() if c is cls), "instance")
        config.instance_id = check_instance_id(config.instance_id or default_instance_id(role), "instance_id")
    return config
