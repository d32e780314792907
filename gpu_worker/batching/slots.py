"""Request slots of a model's KV cache, kept the same way by the verifier
(gpu_worker/verifier/verifier_core.py) and the drafter (gpu_worker/drafter/drafter_core.py).

Both own a model, a KVCache and `requests: (scheduler_id, request_id) -> state` (ids are
unique per scheduler only), where each state holds its cache `slot` and `last_used`
(time.monotonic()). Slots are freed when the scheduler releases them
(docs/PROTOCOL.md#slot-release), when idle longer than slot_idle_ttl_s (their scheduler is
gone), and heartbeats report capacity = max_slots, load = slots in use, free_slots = new
requests the cache would admit now (free slot ids and KV memory, `KVCache.num_admissible`), so
schedulers stop pinning requests to an instance whose memory is short.
`load_model_and_cache` loads the model with its cache from the settings both configs share
(schemas/config.py ModelServiceConfig), dtype "auto" resolved by `resolve_dtype`.
Counters: `slots_<reason>` per freed slot, `release_unknown` per released id without a slot.
An owner with a prefix cache (the verifier's and the model drafter's, gpu_worker/batching/prefix_cache.py)
keeps the storage of a slot released or idle-evicted as a cache entry instead of freeing it
(KEEP_REASONS, `SlotOwner.free_state`).
The NATS service around a slot owner is services/runtime/model_service.py.
"""

from __future__ import annotations

import ctypes
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog
import torch

from gpu_worker.batching.prefix_cache import PrefixCache
from gpu_worker.runtime.checkpoint import load_model, read_config
from gpu_worker.runtime.kernel_paths import KernelReport, report
from gpu_worker.runtime.kv_cache import KVCache
from text.grammar import Grammars
from gpu_worker.runtime.model import Model
from gpu_worker.runtime.quantized import WEIGHT_FORMATS, has_blocks, usable
from schemas.bus.clock import wall as wall_clock
from schemas.config import ModelServiceConfig, parse_bytes
from schemas.bus.control import Heartbeat
from schemas.errors import ErrorCode, SpecbusError

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# x86 AVX512-BF16 / AMX, Arm BF16: CPUs whose matmuls run bf16 natively (else torch emulates it,
# slower than fp32).
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the first CPU's flags (x86) or features (Arm) list a native bf16 instruction."""
    try:
        lines = Path(cpuinfo).read_text().splitlines()
    except OSError:  # not Linux: no way to tell cheaply, so no
        return False
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith(("flags", "Features"))), [])
    return bool(NATIVE_BF16_FLAGS & set(flags))


def serves_blocks(model_dir: str, dtype: torch.dtype, device: str) -> bool:
    """Whether model_dir has GGUF blocks the projection kernel serves in dtype on device."""
    return has_blocks(model_dir) and usable(dtype, device)


def resolve_dtype(name: str, device: str, blocks_dir: str | None = None, weights: str = "auto") -> torch.dtype:
    """The torch dtype for a config's dtype name. "auto": float32 where blocks_dir (the model of
    a service whose weights setting may take its GGUF blocks) has blocks the projection kernel
    serves on this device: the published weights as stored, bit for bit the float32 model, at a
    fifth of its bytes (bfloat16 would round them, a changed model); float32 for weights "int8"
    and "int8dot" (their blocks take float32 activations); else bfloat16 on CUDA and on CPUs with native bf16 (a
    verify of a few tokens then costs what an fp32 decode step does: ops/bench/RESULTS.md), else float32."""
    if name == "auto":
        if blocks_dir is not None and serves_blocks(blocks_dir, torch.float32, device) or weights in ("int8", "int8dot"):
            return torch.float32
        native = device.startswith("cuda") or (device == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise SpecbusError(ErrorCode.invalid_field, f"dtype {name!r} is not one of {['auto', *sorted(DTYPES)]}",
                           "dtype")
    return DTYPES[name]


def resolve_weights(name: str, model_dir: str, dtype: torch.dtype, device: str, dtype_name: str = "auto") -> str:
    """The weights format ("dense", "gguf", "int8" or "int8dot") for a config's weights name
    (ModelServiceConfig `weights`) and dtype name; SpecbusError naming the field where "gguf",
    "int8" or "int8dot" cannot serve. "auto" takes the model's GGUF blocks where they serve: by
    integer dot products (int8dot, llama.cpp's model of the file) under dtype auto, widened to
    float32 (gguf, the float32 model of the file, bit for bit) under dtype float32."""
    if name not in WEIGHT_FORMATS:
        raise SpecbusError(ErrorCode.invalid_field, f"weights {name!r} is not one of {list(WEIGHT_FORMATS)}", "weights")
    if name == "int8":
        if not usable(dtype, device):
            raise SpecbusError(ErrorCode.invalid_field, f"weights int8 needs dtype float32 on a CPU with the projection "
                               f"kernel (dtype here: {str(dtype).removeprefix('torch.')})", "weights")
        return "int8"
    servable = serves_blocks(model_dir, dtype, device)
    if name in ("gguf", "int8dot") and not servable:
        raise SpecbusError(ErrorCode.invalid_field, f"weights {name} needs GGUF blocks in {model_dir} (`specbus models "
                           f"pull` writes them for the default target) and dtype float32 on a CPU with the "
                           f"projection kernel (dtype here: {str(dtype).removeprefix('torch.')})", "weights")
    if name == "auto":
        return ("int8dot" if dtype_name == "auto" else "gguf") if servable else "dense"
    return name


# Why a slot is freed with storage worth keeping for a prefix cache: what it holds was verified
# (not a slot dropped for an error or a memory shortage).
KEEP_REASONS = {"released", "evicted"}


class SlotState(Protocol):
    slot: int
    last_used: float


@dataclass(kw_only=True)
class SlotOwner:
    """What a Verifier and every kind of drafter hold, and the functions below need: requests
    maps (scheduler_id, request_id) to the request's slot state (its SlotState kind is the
    owner's): request ids are unique per scheduler only, so two schedulers' requests with the
    same id must not share (and truncate) one slot. cache: a KVCache (the ngram drafter's
    TokenSlots has its slot calls)."""

    instance_id: str
    cache: KVCache
    model_ids: dict[str, str]
    slot_idle_ttl_s: float
    requests: dict[tuple[str, str], SlotState] = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)
    tokenizer_dir: str | None = None  # its model's tokenizer.json, for grammars
    grammars: Grammars | None = None  # made on first use (gpu_worker/batching/grammar_masks.py)
    prefix: PrefixCache | None = None  # None: no prefix cache (its states need no prefix_root then)

    def free_state(self, state: SlotState, reason: str) -> None:
        """Free a request's slot; with a prefix cache, one freed for a KEEP_REASON whose state has
        a prefix_root is kept as an entry of what `kept` says the slot holds."""
        if self.prefix is None or state.prefix_root is None or reason not in KEEP_REASONS:
            self.cache.free(state.slot)
            return
        token_ids, block_keys, features = self.kept(state)
        self.prefix.keep(state.slot, token_ids, block_keys, state.prefix_root, features)

    def kept(self, state: SlotState) -> tuple[array, list[bytes], torch.Tensor | None]:
        """What a slot keeps as a prefix cache entry: its verified token ids, the keys of its whole
        blocks so far (extended by `PrefixCache.keep`), its features or None."""
        raise NotImplementedError(f"{type(self).__name__} keeps no prefix cache entries")


def model_settings(config: ModelServiceConfig, blocks_dir: str | None = None) -> tuple[torch.dtype, int]:
    """The dtype (resolve_dtype, blocks_dir passed on) and the KV cache's memory budget in bytes of
    config, its other settings checked (SpecbusError naming the field for a bad value) and
    config.torch_threads applied."""
    dtype = resolve_dtype(config.dtype, config.device, blocks_dir, config.weights)
    memory_bytes = parse_bytes(config.kv_cache_memory, "kv_cache_memory")
    if config.prefill_chunk < 1:
        raise SpecbusError(ErrorCode.invalid_field, f"prefill_chunk must be >= 1, got {config.prefill_chunk}",
                           "prefill_chunk")
    if config.torch_threads < 0:
        raise SpecbusError(ErrorCode.invalid_field, f"torch_threads must be >= 0, got {config.torch_threads}",
                           "torch_threads")
    if config.torch_threads:
        # process-wide; worker threads (asyncio.to_thread) pick it up on their first parallel op
        torch.set_num_threads(config.torch_threads)
    return dtype, memory_bytes


def kernel_report(config: ModelServiceConfig, model_dir: str) -> KernelReport:
    """Which path each op runs for a service of config serving model_dir, its dtype and weights
    resolved as `load_model_and_cache` resolves them (gpu_worker/runtime/kernel_paths.py)."""
    dtype = resolve_dtype(config.dtype, config.device, model_dir if config.weights != "dense" else None, config.weights)
    weights = resolve_weights(config.weights, model_dir, dtype, config.device, config.dtype)
    return report(config.device.split(":")[0], str(dtype).removeprefix("torch."), weights,
                  read_config(model_dir).head_dim)


def load_model_and_cache(model_dir: str, config: ModelServiceConfig,
                         side_bytes_per_value: int = 0) -> tuple[Model, KVCache]:
    """The model in model_dir and a KV cache of config.max_slots slots within
    config.kv_cache_memory (device, dtype from config); applies config.torch_threads first.
    side_bytes_per_value: the budget also pays for a row of hidden_size values of this many bytes
    per position (the verifier's feature rows, `KVCache` side_bytes_per_token).
    SpecbusError naming the field for a bad value."""
    dtype, memory_bytes = model_settings(config, model_dir if config.weights != "dense" else None)
    weights = resolve_weights(config.weights, model_dir, dtype, config.device, config.dtype)
    log.info("model_loading", path=model_dir, device=config.device, dtype=str(dtype).removeprefix("torch."),
             weights=weights)
    model, model_config = load_model(model_dir, config.device, dtype, config.max_seq_len, weights)
    cache = KVCache(model_config, config.max_slots, config.max_seq_len, config.device, dtype, memory_bytes,
                    side_bytes_per_value * model_config.hidden_size)
    release_free_heap()
    log.info("kv_cache_budget", memory_bytes=memory_bytes, bytes_per_token=cache.bytes_per_token,
             tokens=memory_bytes // cache.bytes_per_token, max_slots=config.max_slots)
    return model, cache


def release_free_heap() -> None:
    """Hand the heap's free memory back to the OS (glibc's malloc_trim; elsewhere nothing).

    Loading copies each weight a few times (file -> fused -> packed). After the first large
    free, glibc raises its mmap threshold, so later copies come from the heap, and freed heap
    memory stays resident until trimmed (see ops/bench/RESULTS.md, Figures behind gpu_worker's
    choices).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


def free_request(owner: SlotOwner, key: tuple[str, str], reason: str) -> bool:
    """Free the slot of key (scheduler_id, request_id) if it has one, counted as `slots_<reason>`.
    True when freed."""
    state = owner.requests.pop(key, None)
    if state is None:
        return False
    owner.free_state(state, reason)
    owner.counters[f"slots_{reason}"] += 1
    return True


def release(owner: SlotOwner, keys: list[tuple[str, str]]) -> None:
    """Free the slots of finished / cancelled / migrated requests; keys without a slot (already
    evicted, or never seen) are counted."""
    for key in keys:
        if not free_request(owner, key, "released"):
            owner.counters["release_unknown"] += 1


def evict_idle(owner: SlotOwner, now: float | None = None) -> int:
    """Free slots untouched for slot_idle_ttl_s (their scheduler is gone); returns how many.
    now: time.monotonic() (tests pass a later one)."""
    now = time.monotonic() if now is None else now
    idle = [key for key, state in owner.requests.items() if now - state.last_used > owner.slot_idle_ttl_s]
    for key in idle:
        free_request(owner, key, "evicted")
    if idle:
        log.info("slots_evicted", count=len(idle), free_slots=owner.cache.num_free)
    return len(idle)


def instance_heartbeat(owner: SlotOwner, role: str, interval_s: float) -> Heartbeat:
    return Heartbeat(instance_id=owner.instance_id, role=role, capacity=owner.cache.max_slots,
                     load=len(owner.requests), free_slots=owner.cache.num_admissible, model_ids=owner.model_ids,
                     sent_at=wall_clock(), interval_s=interval_s)
