"""Where a request runs: which instances are alive (heartbeats), which of them are compatible
with this scheduler, and which has the most room for a new pin. No NATS, no awaits: the
scheduler's core (scheduler_core.py) owns one `Placement` and asks it at each pin and boundary.

Times are time.monotonic() seconds (local receive times; `now` arguments are there for tests).
"""

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from schemas.bus.control import Heartbeat
from schemas.bus.protocol import ANY_TOKENIZER
from schemas.bus.versions import WINDOW, Window

log = structlog.get_logger(__name__)


@dataclass
class Instance:
    instance_id: str
    role: str | None
    info: Any  # the last heartbeat (any object; the scheduler stores schemas.Heartbeat)
    last_seen: float  # time.monotonic() of the last heartbeat


@dataclass
class InstanceRegistry:
    """Who is alive: an instance is dead once no heartbeat came for timeout_s.

    Times are time.monotonic() seconds (local receive times; `now` is there for tests).
    `alive()`/`is_alive()` are always exact; `reap()` removes the dead and reports them once
    (and calls on_dead for each), so the caller can migrate their work. An instance that beats
    again after being reaped comes back as new.
    """

    timeout_s: float
    on_dead: Callable[[Instance], None] | None = None
    instances: dict[str, Instance] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")

    def observe(self, instance_id: str, info: Any, *, role: str | None = None, now: float | None = None) -> bool:
        """Record a heartbeat; True when the instance is new (or back after being reaped)."""
        now = time.monotonic() if now is None else now
        known = self.instances.get(instance_id)
        self.instances[instance_id] = Instance(instance_id, role, info, now)
        if known is None:
            log.info("instance_joined", instance_id=instance_id, role=role)
        return known is None

    def is_alive(self, instance_id: str, now: float | None = None) -> bool:
        instance = self.instances.get(instance_id)
        now = time.monotonic() if now is None else now
        return instance is not None and now - instance.last_seen <= self.timeout_s

    def alive(self, role: str | None = None, now: float | None = None) -> list[Instance]:
        """Live instances (of `role` if given), sorted by id for a stable order."""
        now = time.monotonic() if now is None else now
        return [
            inst
            for _, inst in sorted(self.instances.items())
            if now - inst.last_seen <= self.timeout_s and (role is None or inst.role == role)
        ]

    def reap(self, now: float | None = None) -> list[Instance]:
        """Remove and return the instances that missed heartbeats for more than timeout_s."""
        now = time.monotonic() if now is None else now
        dead = [inst for inst in self.instances.values() if now - inst.last_seen > self.timeout_s]
        for inst in dead:
            del self.instances[inst.instance_id]
            silent_s = round(now - inst.last_seen, 3)
            log.warning("instance_dead", instance_id=inst.instance_id, role=inst.role, silent_s=silent_s)
            if self.on_dead is not None:
                self.on_dead(inst)
        return dead


class Placement:
    """The instances a scheduler has heard of and its pins on them.

    Compatible = alive, a protocol version window that overlaps the scheduler's (`window`; a
    message to it goes in `version_toward`: the highest both speak), the same tokenizer hash as the scheduler's
    own tokenizer (so text prompts, EOS ids and every instance agree), or, for a drafter with no
    vocabulary of its own (the ngram drafter), tokenizer ANY_TOKENIZER, and not avoided (a
    verifier that failed a batch twice is avoided for heartbeat_timeout_s).
    """

    def __init__(self, heartbeat_timeout_s: float, tokenizer_hash: str,
                 monotonic: Callable[[], float] = time.monotonic, window: Window = WINDOW):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.window = window
        self.tokenizer_hash = tokenizer_hash
        self.monotonic = monotonic
        self.registry = InstanceRegistry(heartbeat_timeout_s)
        self.avoid_until: dict[str, float] = {}  # verifier_id -> monotonic time it is usable again
        self.pinned_since_beat: Counter = Counter()  # requests pinned to an instance since its last heartbeat

    def observe(self, heartbeat: Heartbeat) -> bool:
        """Record a heartbeat; True for an instance not known before."""
        self.pinned_since_beat.pop(heartbeat.instance_id, None)
        return self.registry.observe(heartbeat.instance_id, heartbeat, role=heartbeat.role, now=self.monotonic())

    def reap(self) -> list[Instance]:
        """Forget the instances silent for heartbeat_timeout_s and return them."""
        dead = self.registry.reap(now=self.monotonic())
        for instance in dead:
            self.avoid_until.pop(instance.instance_id, None)
        return dead

    def avoid(self, verifier_id: str) -> None:
        """Pin nothing more on verifier_id for heartbeat_timeout_s."""
        self.avoid_until[verifier_id] = self.monotonic() + self.heartbeat_timeout_s

    def misfit(self, heartbeat: Heartbeat) -> str | None:
        """Why an instance can never take this scheduler's requests, or None when it can."""
        if not self.speaks_with(heartbeat):
            return (f"protocol versions {heartbeat.protocol_min} to {heartbeat.protocol_version}, this scheduler "
                    f"speaks {self.window.low} to {self.window.high}")
        theirs = heartbeat.model_ids.get("tokenizer")
        if heartbeat.role != "scheduler" and not self.fits_tokenizer(heartbeat):
            return f"tokenizer {theirs}, this scheduler's (the target's) is {self.tokenizer_hash}"
        return None

    def speaks_with(self, heartbeat: Heartbeat) -> bool:
        """Whether the instance's version window overlaps ours."""
        return heartbeat.protocol_min <= self.window.high and self.window.low <= heartbeat.protocol_version

    def version_toward(self, *instance_ids: str | None, cap: int | None = None) -> int:
        """The version of a message that reaches these instances (and a client that reads at most
        `cap`): the highest that we and all of them speak (schemas/bus/versions.py). One not heard of
        counts as speaking only our low end."""
        highs = [self.window.low if (inst := self.registry.instances.get(i)) is None else inst.info.protocol_version
                 for i in instance_ids if i is not None]
        return self.window.toward(*highs, *([] if cap is None else [cap]))

    def fits_tokenizer(self, heartbeat: Heartbeat) -> bool:
        theirs = heartbeat.model_ids.get("tokenizer")
        return theirs == self.tokenizer_hash or (heartbeat.role == "drafter" and theirs == ANY_TOKENIZER)

    def compatible(self, role: str, accept: Callable[[Heartbeat], bool] | None = None) -> list[Instance]:
        """Compatible live instances of role (class docstring) whose heartbeat `accept`s, if given."""
        now = self.monotonic()
        return [inst for inst in self.registry.alive(role, now=now)
                if self.speaks_with(inst.info) and self.fits_tokenizer(inst.info)
                and self.avoid_until.get(inst.instance_id, 0.0) <= now and (accept is None or accept(inst.info))]

    def pick(self, role: str, pinned_count: Callable[[str], int], exclude: str | None = None,
             accept: Callable[[Heartbeat], bool] | None = None) -> str | None:
        """The compatible live instance of `role` (whose heartbeat `accept`s, if given) with the
        most room, or None when none has any.
        Room: its reported free slots less what was pinned there since that report, and at most
        its capacity less the scheduler's requests on it (pinned_count), so a burst of admissions
        between two heartbeats does not overfill it."""
        best, best_free = None, 0
        for inst in self.compatible(role, accept):
            if inst.instance_id == exclude:
                continue
            heartbeat = inst.info
            reported = heartbeat.free_slots if heartbeat.free_slots is not None else heartbeat.capacity - heartbeat.load
            free = min(reported - self.pinned_since_beat[inst.instance_id],
                       heartbeat.capacity - pinned_count(inst.instance_id))
            if free > best_free:
                best, best_free = inst.instance_id, free
        return best

    def count_pin(self, instance_id: str | None) -> str | None:
        """Count a new pin on instance_id (until its next heartbeat reports it); returns it."""
        if instance_id is not None:
            self.pinned_since_beat[instance_id] += 1
        return instance_id

    def alive(self, instance_id: str | None) -> bool:
        return instance_id is not None and self.registry.is_alive(instance_id, now=self.monotonic())

    def is_role(self, instance_id: str, role: str) -> bool:
        instance = self.registry.instances.get(instance_id)
        return instance is not None and instance.role == role

    def keeps_prefixes(self, instance_id: str | None) -> bool:
        """Whether the instance's last heartbeat says it keeps a prefix cache (a verifier's
        model_ids["prefix_caching"]: services/scheduler/drafts/prefix_hints.py)."""
        instance = self.registry.instances.get(instance_id)
        return instance is not None and instance.info.model_ids.get("prefix_caching") == "on"

    def max_seq_len(self) -> int | None:
        """The smallest max_seq_len the live compatible verifiers advertise (heartbeat model_ids),
        so a request fits whichever of them it runs or migrates on; None before any is known."""
        limits = [int(inst.info.model_ids["max_seq_len"]) for inst in self.compatible("verifier")
                  if inst.info.model_ids.get("max_seq_len", "").isdigit()]
        return min(limits) if limits else None
