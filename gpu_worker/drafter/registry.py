"""The drafter kinds a drafter process serves: each kind of schemas/draft_kinds.py that proposes in a
drafter (DRAFT_METHODS) -> how it loads and what its service says of it. Every loaded kind is a
gpu_worker/drafter/drafter_protocol.py `Drafter`, so drafter_core.py `draft_batch` answers its
DraftRequests, chains and trees; services/drafter/drafter.py reads `DRAFTERS` by the config's
draft_method.

Adding a drafter kind: its module here (a state class implementing Drafter, and its loader),
its `DraftKind` line in schemas/draft_kinds.py and its line in DRAFTERS below
(tests/gpu_worker/drafter/test_registry.py holds the two lists equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpu_worker.batching.grammar_masks import warm_grammars
from gpu_worker.drafter.drafter_core import ModelDrafter, load_drafter
from gpu_worker.drafter.drafter_protocol import Drafter
from gpu_worker.drafter.eagle_drafter import load_eagle_drafter
from gpu_worker.drafter.ngram import load_ngram_drafter
from schemas.config import DrafterConfig


@dataclass(frozen=True)
class DrafterLoader:
    """How a drafter kind loads (load(config), then warm(drafter) when given, both on the model
    thread), its service's description, and the settings its `drafter_loaded` log line names:
    (log key, DrafterConfig field) pairs."""

    load: Callable[[DrafterConfig], Drafter]
    description: str
    logged: tuple[tuple[str, str], ...] = ()
    warm: Callable[[Drafter], None] | None = None


def warm_model_grammars(drafter: ModelDrafter) -> None:
    """Build the draft model's grammar tables before serving (gpu_worker/batching/grammar_masks.py)."""
    warm_grammars(drafter, drafter.target_vocab_size)


DRAFTERS: dict[str, DrafterLoader] = {
    "model": DrafterLoader(load_drafter, "proposes draft tokens with the draft model",
                           (("model", "draft_model"),), warm_model_grammars),
    "ngram": DrafterLoader(load_ngram_drafter, "proposes draft tokens by prompt lookup (n-gram, no model)"),
    "eagle": DrafterLoader(load_eagle_drafter, "proposes draft tokens with an EAGLE head over the target's features",
                           (("head", "eagle_head"), ("target_model", "target_model"))),
}
