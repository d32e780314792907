"""What a scheduler expects its verifiers' prefix caches to hold: the histories of the requests
it ended on each, so a new request's first prefill chunk can take at once the prefix the cache
will give back (step_planner.py step 4) instead of learning it from the answers, a few chunks
at a time. No NATS, no clocks: services/scheduler/scheduler_core.py owns one `PrefixHints`,
records every ended request (commits.py `Committer.end`) and asks it when it starts one.

A hint is a plan, never a fact: the verifier finds and checks what it holds itself
(gpu_worker/batching/prefix_cache.py), so a hint that is wrong (the entry evicted for memory, the
verifier restarted) makes one step compute more than its budget, by at most the tokens hinted,
and changes no bit of an output. Only verifiers whose heartbeat says they keep a prefix cache
(model_ids["prefix_caching"] "on") get hints, only within one cache_salt (a user's own cache, or
the group the operator lets share one: docs/PROTOCOL.md#prefix-caching), and never for a row
that wants its prompt's logits (the verifier reuses nothing below them). As the verifier drops an
entry whose every block a newer one holds, a history that extends a recorded one replaces it (a
chat's turns keep only the latest); past MAX_HISTORIES the least recently used goes.
"""

from collections import OrderedDict

import numpy as np

from schemas.config import SchedulerConfig

MAX_HISTORIES = 512  # histories kept per scheduler (a few MB of token ids at most)
HINT_BLOCK = 16  # the verifier's PREFIX_BLOCK: it finds an entry by a whole block, so less is no hint

# The cache_salt of the users that share one prefix cache (SchedulerConfig.prefix_cache_shared_users).
SHARED_SALT = "*"


def cache_salt(config: SchedulerConfig, user: str) -> str:
    """Whose prefix cache a user's rows use: its own, or the shared one where the operator says so."""
    shared = {name.strip() for name in config.prefix_cache_shared_users.split(",")}
    return SHARED_SALT if SHARED_SALT in shared or user in shared else f"user:{user}"


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids a and b (int32 arrays) share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixHints:
    """Recorded histories by (verifier_id, cache_salt), least recently used first."""

    def __init__(self, max_histories: int = MAX_HISTORIES):
        self.max_histories = max_histories
        self.histories: OrderedDict[int, tuple[str, str, np.ndarray]] = OrderedDict()
        self.next_key = 0

    def record(self, verifier_id: str, salt: str, token_ids: list[int]) -> None:
        """The verifier now holds token_ids (a released slot's history) in salt's cache."""
        if len(token_ids) < HINT_BLOCK:
            return
        ids = np.asarray(token_ids, dtype=np.int32)
        for key, (verifier, other_salt, old) in list(self.histories.items()):
            if (verifier, other_salt) == (verifier_id, salt) and common_prefix_len(old, ids) == len(old):
                del self.histories[key]
        self.histories[self.next_key] = (verifier_id, salt, ids)
        self.next_key += 1
        while len(self.histories) > self.max_histories:
            self.histories.popitem(last=False)

    def expected(self, verifier_id: str, salt: str, token_ids: list[int]) -> int:
        """The longest prefix of token_ids that a recorded history of that verifier and salt
        shares (0 below HINT_BLOCK); the history that gives it becomes the most recently used."""
        ids = np.asarray(token_ids, dtype=np.int32)
        best, best_key = 0, None
        for key, (verifier, other_salt, old) in self.histories.items():
            if (verifier, other_salt) == (verifier_id, salt):
                length = common_prefix_len(old, ids)
                if length > best:
                    best, best_key = length, key
        if best < HINT_BLOCK:
            return 0
        self.histories.move_to_end(best_key)
        return best
