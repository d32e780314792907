"""The repository explains itself, and its explanations stay true:

- the generated tables of docs/PROTOCOL.md are what schemas/ produces today;
- README.md stays a five-minute read (at most MAX_README_LINES lines; the rest is in docs/);
- every `*.md` a docstring or comment (Python or C++) names, every relative link of a markdown file (with its
  #anchor) and every repository path the README and docs/ name in code spans exists, and
  docs/ARCHITECTURE.md names every module of schemas/, text/, gpu_worker/ and services/;
- the layering of docs/ARCHITECTURE.md holds: schemas <- text <- gpu_worker <- services <- ops,
  inside services/ runtime <- client, scheduler | verifier | drafter | postprocessor <- gateway,
  launch <- commands <- cli; no import
  circle anywhere; gpu_worker/ knows nothing of asyncio or NATS; the scheduler, postprocessor,
  client, gateway and `specbus models` never import torch;
- tests/ mirrors the packages (docs/ARCHITECTURE.md#naming): each tests/<package>/.../test_<name>.py
  is the test of an existing module, and what is no module's test lives in tests/system/;
- no folder holds more than MAX_FOLDER_MODULES modules (tests/ included);
- the code (schemas/, text/, gpu_worker/, services/, ops/; not tests/) stays small: no module
  over MAX_MODULE_LINES lines, no class with more than MAX_CLASS_METHODS methods, no function
  over MAX_FUNCTION_LINES lines;
- its docstrings and comments (C++ ones too) state contracts, not measurements or history: no measured figure
  (MEASURED_FIGURE below says which) and no issue or session number. Figures live in
  ops/bench/RESULTS.md, history in git;
- models/ holds what is served, never training state (TRAINING_STATE: checkpoints, optimizer
  moments), which lives under $SPECBUS_HOME or in a release artifact.

Each check lists every offence as file:line and what, so one run shows all that is left.
"""

import ast
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

from schemas.doc_tables import PROTOCOL_MD, stale_blocks

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"node_modules", "build", "dist", "__pycache__", "shared"}
MD_NAME = re.compile(r"(?<![\w/.-])((?:\.\.?/)*(?:[\w.-]+/)*[\w-][\w.-]*\.md)(#[\w-]+)?")
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
CODE_PATH = re.compile(r"`((?:schemas|text|services|gpu_worker|ops|tests|models|docs)/[\w./-]*)`")
LAYERS = {"schemas": {"text", "gpu_worker", "services", "ops"}, "text": {"gpu_worker", "services", "ops"},
          "gpu_worker": {"services", "ops"}, "services": {"ops"}}
# Inside services/: a room may import the rooms left of it in
# runtime <- client, <role> <- gateway, launch <- commands <- cli, where <role> is one of the four
# pipeline services (each its own room, none importing another); client and the roles are
# independent, and so are gateway and launch.
ROLE_ROOMS = ("scheduler", "verifier", "drafter", "postprocessor")
SERVICE_ROOMS = ("runtime", "client", *ROLE_ROOMS, "gateway", "launch", "commands", "cli")
SERVICE_ROOM_FORBIDDEN = {
    "runtime": {"client", *ROLE_ROOMS, "gateway", "launch", "commands", "cli"},
    "client": {*ROLE_ROOMS, "gateway", "launch", "commands", "cli"},
    **{role: {"client", *(set(ROLE_ROOMS) - {role}), "gateway", "launch", "commands", "cli"} for role in ROLE_ROOMS},
    "gateway": {*ROLE_ROOMS, "launch", "commands", "cli"},
    "launch": {*ROLE_ROOMS, "gateway", "commands", "cli"},
    "commands": {*ROLE_ROOMS, "gateway", "cli"},
}
NO_ASYNC_IN_GPU_WORKER = {"asyncio", "nats"}
MIRRORED = ("schemas", "text", "gpu_worker", "services", "ops")  # the packages tests/ mirrors
CODE = MIRRORED  # what the size and docstring checks read: everything but tests/
MAX_MODULE_LINES = 700
MAX_CLASS_METHODS = 25  # the defs of the class body, properties included
MAX_FUNCTION_LINES = 80  # from its `def` line to its last, docstring included
MAX_FOLDER_MODULES = 12  # .py files in one folder, __init__.py included: past it, the folder wants rooms
MAX_README_LINES = 250  # a newcomer's five minutes; the rest lives in docs/
# A figure: a number or a range of them ("7", "0.5", "7-20") with a unit of time, a rate or a share (%).
NUMBER = r"\d+(?:[.,]\d+)?(?:\s*[-\u2013]\s*\d+(?:[.,]\d+)?)?"
TIME_UNIT = r"(?:ns|\u00b5s|us|ms|s|secs?|seconds?|min|mins|minutes?|h|hours?)\b"
RATE = r"(?:(?:tokens?|tok|steps?|it|req|requests?|calls?)\s*/\s*s\b|(?:tokens?|steps?|requests?) (?:per|a) second)"
MEMORY_UNIT = r"(?:[KMGT]i?B|bytes)\b"
PERCENT_SIGN = r"(?:%|per ?cent\b)"
PERCENT = rf"{NUMBER}\s*{PERCENT_SIGN}"
# What makes a figure a measurement rather than a contract. A default, a timeout or a bound
# ("a 10 s default", "timeout_s (seconds)", "after 0.5 s, doubling up to 30 s") is a contract
# and passes; these are how measurements read:
MEASURED_FIGURE = {
    "an approximate figure": rf"(?:~|\u2248|\babout |\baround |\broughly |\bnearly )\s*{NUMBER}\s*"
                             rf"(?:{TIME_UNIT}|{RATE}|{PERCENT_SIGN})",
    "a time per operation": rf"{NUMBER}\s*{TIME_UNIT}\s+(?:per|a|an|each)\s+(?:call|step|token|forward|request|row|batch|"
                            r"run|draft|verify|position|iteration)s?\b",
    "a rate": rf"{NUMBER}\s*{RATE}",
    "figures compared": rf"{NUMBER}\s*{TIME_UNIT}\s+(?:against|instead of|vs\.?|versus|than)\s+{NUMBER}",
    "a figure of a machine or setting": rf"{NUMBER}\s*{TIME_UNIT}\s+(?:at|on|with)\s+(?:\d|[A-Za-z_]+\s*=\s*\d|this "
                                        r"(?:CPU|machine)|a (?:shared|busy|loaded))",
    "a measured figure": rf"\bmeasured\b[^.;]{{0,80}}?(?:{NUMBER}\s*(?:{TIME_UNIT}|{RATE}|{MEMORY_UNIT})|{PERCENT})",
    # A share is a contract when it is a setting ("10% of the budget"), a measurement when it
    # compares: "25% more than", "(10% slower)", "25-30% less".
    "a percentage compared": rf"{PERCENT}\s+(?:more|less|fewer|faster|slower|quicker|higher|lower|better|worse|"
                             r"cheaper|above|below|over|under|than|of (?:a|the|one) \w+ (?:step|forward|call|run))\b",
    "a speed-up": rf"{NUMBER}\s*[x\u00d7]\s+(?:faster|slower|speed-?up)",
    "a ratio": rf"{NUMBER}[x\u00d7]\s+(?:too|more|less|fewer|larger|smaller|of (?:the|its|their|a)|on|at|against|than|"
               r"over)\b",
}
HISTORY = {"an issue number": r"\bissues?\s+#?\d+", "a session number": r"\bsessions?\s+#?\d+"}
TORCH_FREE = ("schemas", "text.tokenizer", "text.token_bytes", "text.chat_template", "schemas.doc_tables", "services.scheduler.scheduler", "services.postprocessor.postprocessor", "services.client",
              "services.gateway.gateway", "services.commands.models")


def repo_files(suffix: str) -> list[Path]:
    """Files of the repository with this suffix, outside hidden, virtualenv and build folders."""
    found = []
    for path in ROOT.rglob(f"*{suffix}"):
        parts = path.relative_to(ROOT).parts[:-1]
        if not any(part.startswith(".") or part in SKIP_DIRS or part.endswith(".egg-info") for part in parts):
            found.append(path)
    return sorted(found)


def docs_and_comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment in a Python file."""
    source = path.read_text()
    texts = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                texts.append((first.lineno, first.value.value))
    return texts


def cpp_comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment in a C++ file: a run of `//` lines is one text (markers
    dropped, lines kept), a `/* */` block another; string and character literals are skipped."""
    source, texts, i, line = path.read_text(), [], 0, 1
    last_line_comment = None  # [first line, text, line it ended on] of the run of // comments
    while i < len(source):
        char = source[i]
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = len(source) if end < 0 else end
            if last_line_comment and last_line_comment[2] == line - 1:
                last_line_comment[1] += "\n" + source[i + 2:end]
                last_line_comment[2] = line
            else:
                last_line_comment = [line, source[i + 2:end], line]
                texts.append(last_line_comment)
            i = end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = len(source) if end < 0 else end
            block = source[i + 2:end]
            texts.append([line, "\n".join(part.strip().lstrip("*") for part in block.split("\n")), None])
            line += block.count("\n")
            i = end + 2
        elif char in "\"'":
            end = i + 1
            while end < len(source) and source[end] != char and source[end] != "\n":
                end += 2 if source[end] == "\\" else 1
            i = end + 1
        else:
            line += char == "\n"
            i += 1
    return [(first, text) for first, text, _ in texts]


CPP_SUFFIXES = (".cpp", ".h")


def comment_texts(path: Path) -> list[tuple[int, str]]:
    """The docstrings and comments of a Python or C++ file."""
    return cpp_comments(path) if path.suffix in CPP_SUFFIXES else docs_and_comments(path)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def check_reference(source: Path, target: str, anchor: str | None) -> str | None:
    """None when target (relative to the repo root or to source's folder) exists and has the anchor."""
    candidates = [ROOT / target, source.parent / target] if target else [source]
    existing = [c.resolve() for c in candidates if c.exists()]
    inside = [c for c in existing if c.is_relative_to(ROOT)]
    if not inside:
        return f"{target} does not exist in the repository"
    if anchor and inside[0].suffix == ".md" and anchor not in anchors(inside[0]):
        return f"{target or source.name} has no section #{anchor}"
    return None


def test_protocol_tables_match_the_schemas():
    stale = stale_blocks(PROTOCOL_MD.read_text())
    assert not stale, (f"docs/PROTOCOL.md: generated tables out of date ({', '.join(stale)}); "
                       f"run `.venv/bin/python -m schemas.doc_tables` and commit the result")


def test_every_md_named_in_python_exists():
    problems = []
    for path in [*repo_files(".py"), *(path for suffix in CPP_SUFFIXES for path in repo_files(suffix))]:
        for line, text in comment_texts(path):
            text = URL.sub(lambda url: " " * len(url.group()), text)  # same offsets, for line numbers
            for match in MD_NAME.finditer(text):
                problem = check_reference(path, match.group(1), (match.group(2) or "#")[1:] or None)
                if problem:
                    problems.append(f"{path.relative_to(ROOT)}:{line + text[:match.start()].count(chr(10))}: {problem}")
    assert not problems, "dangling .md references:\n" + "\n".join(problems)


def test_every_relative_link_in_markdown_exists():
    problems = []
    for path in repo_files(".md"):
        in_code = False
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for link in MD_LINK.findall(line):
                if URL.match(link) or link.startswith("mailto:"):
                    continue
                target, _, anchor = link.partition("#")
                problem = check_reference(path, target, anchor or None) if target or anchor else None
                if problem:
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {link}: {problem}")
    assert not problems, "dangling links:\n" + "\n".join(problems)


def test_readme_is_a_five_minute_read():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, (f"README.md: {lines} lines (at most {MAX_README_LINES}): move the detail into "
                                       f"docs/ (GUIDE, HTTP_API, OPERATIONS, PERFORMANCE, RUNTIME) and link it")


def test_paths_named_in_docs_exist():
    problems = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for name in CODE_PATH.findall(line):
                if not (ROOT / name.rstrip("/")).exists():
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {name} does not exist")
    assert not problems, "paths named in the docs that are not in the repository:\n" + "\n".join(problems)


def test_every_module_is_on_the_map():
    architecture = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [str(path.relative_to(ROOT)) for package in LAYERS for path in sorted((ROOT / package).rglob("*.py"))
               if path.name != "__init__.py" and f"`{path.relative_to(ROOT)}`" not in architecture]
    assert not missing, f"modules docs/ARCHITECTURE.md does not name (add them to its Module map): {missing}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file, at module level or inside functions;
    `from a.b import c` names a.b.c when that is a module of ours, else a.b."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (ROOT / Path(*sub.split(".")) / "__init__.py").exists()
                found.append((node.lineno, sub if is_module else node.module))
    return found


def package_files() -> list[Path]:
    return [path for path in repo_files(".py") if path.relative_to(ROOT).parts[0] in LAYERS]


def service_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 1 else None


def test_layers_import_only_downwards():
    problems = []
    for path in package_files():
        package = path.relative_to(ROOT).parts[0]
        room = service_room(module_name(path))
        for line, name in imports(path):
            if name.split(".")[0] in LAYERS[package]:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
            elif room in SERVICE_ROOM_FORBIDDEN and service_room(name) in SERVICE_ROOM_FORBIDDEN[room]:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {name} (services/{room} may not)")
    assert not problems, "imports against the layering (docs/ARCHITECTURE.md#layering):\n" + "\n".join(problems)


def test_no_import_circle():
    """Tarjan's strongly connected components over our modules' imports (function-level ones too)."""
    graph = {module_name(path): {name for _, name in imports(path)} for path in package_files()}
    graph = {module: {name for name in names if name in graph and name != module} for module, names in graph.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for name in sorted(graph[module]):
            if name not in index:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in on_stack:
                low[module] = min(low[module], index[name])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_gpu_worker_knows_no_asyncio_or_nats():
    problems = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in package_files()
                if path.relative_to(ROOT).parts[0] == "gpu_worker" for line, name in imports(path)
                if name.split(".")[0] in NO_ASYNC_IN_GPU_WORKER]
    assert not problems, "gpu_worker/ is the tensor layer, without asyncio or NATS:\n" + "\n".join(problems)


def test_torch_free_modules_stay_torch_free():
    code = f"import importlib, sys\nfor m in {TORCH_FREE!r}: importlib.import_module(m)\n" \
           "assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing {TORCH_FREE} pulled in torch:\n{result.stderr[-2000:]}"


def mirrored_module(test: Path) -> Path | None:
    """The module tests/<package>/.../test_<name>.py tests: <package>/.../<name>.py, or for
    test_<module>_<aspect>.py (one aspect of a module in a file of its own) <module>.py; None
    when there is none."""
    relative = test.relative_to(ROOT / "tests")
    name = test.stem.removeprefix("test_")
    stems = [name] + [name[:i] for i, char in enumerate(name) if char == "_"]
    return next((ROOT / relative.parent / f"{stem}.py" for stem in stems
                 if (ROOT / relative.parent / f"{stem}.py").is_file()), None)


def test_tests_mirror_the_packages():
    problems = []
    for test in sorted((ROOT / "tests").rglob("test_*.py")):
        relative = test.relative_to(ROOT / "tests")
        if relative.parts[0] == "system" or relative == Path("test_docs.py"):
            continue
        if relative.parts[0] not in MIRRORED:
            problems.append(f"tests/{relative}: under no package's mirror ({', '.join(MIRRORED)}) nor tests/system/")
        elif mirrored_module(test) is None:
            problems.append(f"tests/{relative}: no module {relative.parent}/{test.stem.removeprefix('test_')}.py "
                            f"(or {relative.parent}/<module>.py for test_<module>_<aspect>.py) to test")
    assert not problems, "test modules that mirror no module (move them, or to tests/system/):\n" + "\n".join(problems)


def code_files(suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    return [path for suffix in suffixes for path in repo_files(suffix) if path.relative_to(ROOT).parts[0] in CODE]


def test_modules_classes_and_functions_stay_small():
    problems = []
    for path in code_files():
        source = path.read_text()
        name = path.relative_to(ROOT)
        if len(source.splitlines()) > MAX_MODULE_LINES:
            problems.append(f"{name}: {len(source.splitlines())} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
                if methods > MAX_CLASS_METHODS:
                    problems.append(f"{name}:{node.lineno}: class {node.name} has {methods} methods "
                                    f"(at most {MAX_CLASS_METHODS})")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    problems.append(f"{name}:{node.lineno}: {node.name}() is {lines} lines (at most {MAX_FUNCTION_LINES})")
    assert not problems, (
        "too large (split along the jobs it does, docs/ARCHITECTURE.md#naming):\n" + "\n".join(problems))


def test_folders_stay_small():
    """A folder a newcomer can read from the listing: at most MAX_FOLDER_MODULES modules, tests too."""
    folders: dict[Path, int] = {}
    for path in repo_files(".py"):
        folders[path.parent] = folders.get(path.parent, 0) + 1
    problems = [f"{folder.relative_to(ROOT)}/: {count} modules (at most {MAX_FOLDER_MODULES})"
                for folder, count in sorted(folders.items()) if count > MAX_FOLDER_MODULES]
    assert not problems, "folders to split into rooms (docs/ARCHITECTURE.md#layering):\n" + "\n".join(problems)


def test_class_names_are_unique():
    """docs/ARCHITECTURE.md#naming: a class name in a log, a traceback or a search means one thing."""
    defined: dict[str, list[str]] = {}
    for path in code_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    twice = [f"class {name}: {', '.join(places)}" for name, places in sorted(defined.items()) if len(places) > 1]
    assert not twice, "class names defined more than once (rename all but one):\n" + "\n".join(twice)


def offences(rules: dict[str, str]) -> list[str]:
    """file:line: what: 'the words', for every stretch of a docstring or comment of the code (its
    Python and C++ files) that a rule matches (overlapping matches of several rules are one stretch, named by each)."""
    patterns = {what: re.compile(rule, re.IGNORECASE) for what, rule in rules.items()}
    found = []
    for path in code_files((".py", *CPP_SUFFIXES)):
        for line, text in comment_texts(path):
            spans = sorted((match.start(), match.end(), what) for what, pattern in patterns.items()
                           for match in pattern.finditer(text))
            merged: list[list] = []  # [start, end, whats]
            for start, end, what in spans:
                if merged and start < merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                    merged[-1][2] += [what] if what not in merged[-1][2] else []
                else:
                    merged.append([start, end, [what]])
            found += [(path.relative_to(ROOT), line + text[:start].count("\n"),
                       f"{', '.join(whats)}: {' '.join(text[start:end].split())!r}") for start, end, whats in merged]
    return [f"{name}:{at}: {what}" for name, at, what in sorted(found)]


def test_cpp_comments_are_read(tmp_path):
    """The guards see a C++ file's comments (a run of // lines as one text), and not its strings."""
    source = tmp_path / "kernel.cpp"
    source.write_text('int a = 1;  // first\n// second\nconst char* s = "// no comment";\n/* a block\n * 3 ms per call */\n')
    assert cpp_comments(source) == [(1, " first\n second"), (4, "a block\n 3 ms per call")]
    assert re.search(MEASURED_FIGURE["a time per operation"], cpp_comments(source)[1][1])


def test_docstrings_and_comments_carry_no_measured_figures():
    problems = offences(MEASURED_FIGURE)
    assert not problems, ("measured figures in docstrings or comments (state the contract; figures go to "
                          "ops/bench/RESULTS.md, docs/ARCHITECTURE.md#naming):\n" + "\n".join(problems))


def test_docstrings_and_comments_carry_no_issue_or_session_numbers():
    problems = offences(HISTORY)
    assert not problems, "work history in docstrings or comments (say what holds now):\n" + "\n".join(problems)


# a file or folder name, or a tensor name in a safetensors file, that is training state, not weights
TRAINING_STATE = re.compile(r"train_state|optimi[sz]er|checkpoint|exp_avg|adam|\.ckpt$|\.pt$|\.pth$", re.IGNORECASE)


def test_models_hold_what_is_served_not_training_state():
    problems = []
    for path in sorted((ROOT / "models").rglob("*")):
        name = path.relative_to(ROOT)
        if TRAINING_STATE.search(path.name):
            problems.append(f"{name}: named like training state")
        elif path.suffix == ".safetensors" and path.is_file():
            with path.open("rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            state = sorted(key for key in header if key != "__metadata__" and TRAINING_STATE.search(key))
            problems += [f"{name}: holds {', '.join(state[:3])}"] if state else []
    assert not problems, ("models/ holds what is served; training state goes under $SPECBUS_HOME or a release "
                          "artifact (models/README.md, Accumulating training):\n" + "\n".join(problems))
