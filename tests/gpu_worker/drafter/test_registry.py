"""The draft kinds are listed once (schemas/draft_kinds.py) and every consumer reads that list:
the drafter registry, the CLI's and `specbus up`'s flags, the request schema, the gateway's body,
the drafter config and the scheduler's "auto" order."""

import argparse
import ast
import typing
from pathlib import Path

import pytest

from gpu_worker.drafter.drafter_core import ModelDrafter
from gpu_worker.drafter.drafter_protocol import Drafter
from gpu_worker.drafter.eagle_drafter import EagleDrafter
from gpu_worker.drafter.ngram import NgramDrafter
from gpu_worker.drafter.registry import DRAFTERS
from schemas.config import DrafterConfig, load_config
from schemas.draft_kinds import AUTO_TRIAL_ORDER, DRAFT_KINDS, DRAFT_METHOD_CHOICES, DRAFT_METHODS
from schemas.errors import SpecbusError
from schemas.generation import SpeculativeOptions
from services.cli import build_parser
from services.gateway.request_bodies import CompletionBody
from services.scheduler.drafts.draft_method import METHODS

ROOT = Path(__file__).resolve().parents[3]


def draft_method_choices(parser: argparse.ArgumentParser) -> list[tuple]:
    """The choices of every --draft-method flag of parser and its subcommands."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += draft_method_choices(sub)
        elif action.dest == "draft_method" and action.choices is not None:
            found.append(tuple(action.choices))
    return found


def test_the_registry_loads_every_drafter_kind_and_only_those():
    assert tuple(DRAFTERS) == DRAFT_METHODS
    assert {name for name, kind in DRAFT_KINDS.items() if kind.proposer == "drafter"} == set(DRAFTERS)


def test_every_consumer_reads_the_one_list():
    choices = draft_method_choices(build_parser())
    assert DRAFT_METHOD_CHOICES in choices and DRAFT_METHODS in choices  # `generate` and `up`
    assert set(choices) == {DRAFT_METHOD_CHOICES, DRAFT_METHODS}
    assert typing.get_args(SpeculativeOptions.model_fields["draft_method"].annotation) == DRAFT_METHOD_CHOICES
    gateway = typing.get_args(CompletionBody.model_fields["draft_method"].annotation)
    assert typing.Literal[DRAFT_METHOD_CHOICES] in gateway
    assert sorted(METHODS) == sorted(DRAFT_METHODS) and METHODS == AUTO_TRIAL_ORDER
    for name in DRAFT_METHODS:
        assert load_config(DrafterConfig, env={}, draft_method=name).draft_method == name
    for name in set(DRAFT_KINDS) - set(DRAFT_METHODS):  # proposed by the scheduler: no drafter serves it
        with pytest.raises(SpecbusError) as raised:
            load_config(DrafterConfig, env={}, draft_method=name)
        assert raised.value.field == "draft_method"


def test_every_drafter_kind_has_the_protocols_steps():
    steps = [name for name in Drafter.__dict__ if name in ("check", "prepare", "propose")]
    assert len(steps) == 3
    for kind in (ModelDrafter, NgramDrafter, EagleDrafter):
        assert all(callable(getattr(kind, step, None)) for step in steps), kind


def test_no_other_module_lists_the_kinds():
    """A tuple, list or set literal naming two kinds or more is a second list of them."""
    names = set(DRAFT_KINDS)
    offences = []
    for package in ("schemas", "text", "gpu_worker", "services"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT) == Path("schemas/draft_kinds.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    named = {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names}
                    if len(named) > 1:
                        offences.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(named)}")
    assert not offences, "the draft kinds listed outside schemas/draft_kinds.py:\n" + "\n".join(offences)
