"""A stand-in for a Verifier or a Drafter as gpu_worker/batching/slots.py's functions see it: a KV
cache of a tiny random Llama (MAX_SLOTS slots), its request slots and counters. The fixtures
`model_dir` and `owner` (tests/conftest.py) hold one; the slot tests and the model service's
idle eviction test use it."""

from collections import Counter
from dataclasses import dataclass, field

from gpu_worker.batching.slots import SlotOwner, load_model_and_cache
from gpu_worker.runtime.kv_cache import KVCache
from schemas.config import VerifierConfig, load_config

MAX_SLOTS = 3


@dataclass
class Slot:
    slot: int
    last_used: float


@dataclass
class Owner:
    """The fields the slot functions read, as a Verifier or a Drafter has them."""

    cache: KVCache
    slot_idle_ttl_s: float
    instance_id: str = "owner-test"
    model_ids: dict[str, str] = field(default_factory=lambda: {"target": "tiny"})
    requests: dict[str, Slot] = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)
    prefix: None = None  # no prefix cache: SlotOwner.free_state frees every slot

    free_state = SlotOwner.free_state


def config(model_dir, **overrides):
    return load_config(VerifierConfig, env={}, target_model=str(model_dir), instance_id="verifier-test",
                       max_slots=MAX_SLOTS, max_seq_len=32, **{"dtype": "float32", **overrides})


def new_owner(model_dir) -> Owner:
    """An owner of a fresh cache of model_dir, slots idle for 60 s evicted."""
    _, cache = load_model_and_cache(str(model_dir), config(model_dir))
    return Owner(cache=cache, slot_idle_ttl_s=60.0)


def take(owner, request_id, last_used):
    owner.requests[request_id] = Slot(owner.cache.allocate(), last_used)
