"""The draft kinds, listed once: every value a drafter's or a request's draft_method may take, and
what each kind is. Torch-free: the CLI, the gateway, the configs, the launcher and the scheduler
read it; the drafter kinds' loaders are gpu_worker/drafter/registry.py `DRAFTERS`, keyed by these
names (a test holds the two equal).

A kind proposes either in a drafter process (proposer "drafter": a `--draft-method` of the
drafter service, gpu_worker/drafter/drafter_protocol.py `Drafter`) or in the scheduler itself
(proposer "scheduler": the scheduler's suffix index, services/scheduler/drafts/suffix_choice.py;
no drafter is pinned for it). A request's draft_method is one of DRAFT_METHOD_CHOICES: "auto"
(whichever drafter kind is live and measures better, services/scheduler/drafts/draft_method.py)
or a kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DraftKind:
    """One draft kind. model_setting: the DrafterConfig field naming the directory it loads (None:
    it loads no model). fits: which targets its drafts serve: "any" (its drafts are ids of the
    request's own history), "tokenizer" (a target with its tokenizer: placement compares the
    heartbeats' tokenizer hashes) or "target" (only the target it was trained for, whose embedding
    it reads: its heartbeat's model_ids["target"] must be the verifier's). reads_features: its
    draft rows carry the target's features (FeatureBlocks, services/scheduler/features.py).
    trial: its place in "auto"'s trial order among the drafter kinds, cheapest first (a tie in
    acceptance goes to the earlier)."""

    name: str
    proposer: Literal["drafter", "scheduler"]
    model_setting: str | None = None
    fits: Literal["any", "tokenizer", "target"] = "any"
    reads_features: bool = False
    trial: int = 0


DRAFT_KINDS: dict[str, DraftKind] = {kind.name: kind for kind in (
    DraftKind("model", "drafter", model_setting="draft_model", fits="tokenizer", trial=2),  # a draft model
    DraftKind("ngram", "drafter", trial=0),  # prompt lookup, no model (gpu_worker/drafter/ngram.py)
    DraftKind("eagle", "drafter", model_setting="eagle_head", fits="target", reads_features=True,
              trial=1),  # an EAGLE head over the target's features (gpu_worker/drafter/eagle_drafter.py)
    DraftKind("suffix", "scheduler"),  # the scheduler's suffix index (services/scheduler/drafts/suffix_index.py)
)}
# A drafter's kind when none is given, and a heartbeat's without model_ids["draft_method"]
# (drafters from before the field).
DEFAULT_DRAFT_METHOD = "model"
# a drafter's --draft-method
DRAFT_METHODS = tuple(name for name, kind in DRAFT_KINDS.items() if kind.proposer == "drafter")
# "auto"'s trial order over the drafter kinds
AUTO_TRIAL_ORDER = tuple(sorted(DRAFT_METHODS, key=lambda name: DRAFT_KINDS[name].trial))
# a request's draft_method (SpeculativeOptions); the gateway's body and the CLI take this list
DRAFT_METHOD_CHOICES = ("auto", *DRAFT_METHODS, *(name for name, kind in DRAFT_KINDS.items()
                                                  if kind.proposer == "scheduler"))


def proposes_in_scheduler(draft_method: str) -> bool:
    """Whether a request of this draft_method drafts in the scheduler only (no drafter is asked)."""
    kind = DRAFT_KINDS.get(draft_method)
    return kind is not None and kind.proposer == "scheduler"


def reads_features(draft_method: str) -> bool:
    """Whether a drafter of this draft_method wants the target's features in its rows."""
    kind = DRAFT_KINDS.get(draft_method)
    return kind is not None and kind.reads_features
