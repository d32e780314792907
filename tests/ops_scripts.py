"""The training scripts of ops/train/ as modules for tests: each run loads a fresh copy, so a test may
monkeypatch its globals (OUT, DRAFT_VOCAB) without touching another test's."""

import importlib.util
import sys
from pathlib import Path

OPS = Path(__file__).resolve().parents[1] / "ops" / "train"


def load_ops_script(name: str):
    """A fresh module of ops/train/<name>.py (ops/train/ on sys.path, for its sibling imports)."""
    if str(OPS) not in sys.path:
        sys.path.insert(0, str(OPS))
    spec = importlib.util.spec_from_file_location(name, OPS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_train_eagle():
    """A fresh module of ops/train/train_eagle.py."""
    return load_ops_script("train_eagle")
