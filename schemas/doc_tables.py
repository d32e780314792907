"""The tables of docs/PROTOCOL.md that the schemas can produce, rendered from the code.

    python -m schemas.doc_tables            rewrite the generated blocks of docs/PROTOCOL.md
    python -m schemas.doc_tables --check    exit 1 (and say which block) when they are stale

A generated block sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; NAME is
one of `subjects`, `errors`, `limits`, `types`, `model <ClassName>` (one pydantic model's fields)
or `other-models` (every model reachable from MESSAGE_TYPES that has no block of its own, so a
new message shows up in the document as soon as it is regenerated). A field's notes are its
`description`, else the source comment on (or just above) its line, else the sentence of its
class docstring that starts with `name:`, so documenting a field in schemas/ documents it here.
Torch-free: imports only schemas/.
"""

import argparse
import ast
import inspect
import io
import re
import sys
import tokenize
import types
import typing
from enum import Enum
from pathlib import Path

import annotated_types
import numpy as np
from pydantic import BaseModel, StringConstraints
from pydantic.fields import FieldInfo

from schemas import arrays, commits, config, generation, steps, streams
from schemas.bus import codec, control, protocol, subjects, wire
from schemas.arrays import Packed
from schemas.bus.codec import MESSAGE_TYPES
from schemas.errors import ErrorCode
from schemas.bus.subjects import Subjects

PROTOCOL_MD = Path(__file__).resolve().parent.parent / "docs" / "PROTOCOL.md"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[^>]+?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)

# Who talks on each subject (the pattern itself comes from schemas.bus.subjects.Subjects), as
# (from, to, message, delivery); None for a member that is only the root of other subjects.
# A new Subjects member needs a row here: the generator refuses to render without one.
SUBJECT_ROUTES = {
    "generate_for": ("client user `<user>`", "one scheduler (queue group `schedulers`)", "GenerateRequest",
                     "publish with reply = the client's inbox; Admitted (on arrival, on start) and the StreamChunks "
                     "(or one Error chunk) come back there"),
    "cancel_for": ("client user `<user>`", "every scheduler", "CancelRequest",
                   "publish; the owning scheduler acts, others ignore it"),
    "generate": None,  # the scheduler subscribes `<p>.generate.*`
    "cancel": None,  # every scheduler subscribes `<p>.cancel.*`
    "heartbeat": ("every instance", "every scheduler, the clients (scheduler failover), the stack launcher",
                  "Heartbeat", "publish every `interval_s`"),
    "draft": ("scheduler", "that drafter", "DraftRequest", "request; reply DraftResponse or Error"),
    "verify": ("scheduler", "that verifier", "VerifyRequest", "request; reply VerifyResponse or Error"),
    "post_commit": ("scheduler", "that postprocessor", "Commit", "publish, no reply"),
    "post_side": ("verifier", "that postprocessor", "SideChannelRecord", "publish after the VerifyResponse, no reply"),
    "stop_notice": ("postprocessor", "the scheduler that owns the request", "StopNotice",
                    "publish (a nats.micro endpoint `stop`), no reply"),
}

# The modules that define the models on the bus: their docstrings and comments are the notes of
# the model tables, their Annotated aliases the named types.
MESSAGE_MODULES = (wire, generation, streams, steps, commits, control)
# Named constants of the wire protocol, by module: (module, names), None for every constant it defines.
LIMITS = ((protocol, None), (config, ("MAX_MESSAGE_BYTES",)), (codec, None), (arrays, None), (subjects, None))
MODEL_MODULE_NAMES = {module.__name__ for module in MESSAGE_MODULES}


# ---------------------------------------------------------------------------------------------
# source comments


def source_comments(obj) -> dict[str, str]:
    """name -> comment for each `name: ...` / `name = ...` line of obj's source (a class body or
    a module): the comment on that line, else the comment lines right above it."""
    source = inspect.getsource(obj)
    lines = source.splitlines()
    comment_at: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comment_at[token.start[0]] = token.string.lstrip("#").strip()
    body_indent = 4 if inspect.isclass(obj) else 0
    found: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        match = re.match(r"( *)(\w+)\s*[:=]", line)
        if not match or len(match.group(1)) != body_indent or match.group(2) in found:
            continue
        comment = comment_at.get(number) if not line.lstrip().startswith("#") else None
        if comment is None:
            above = []
            row = number - 1
            # a block comment right above; a section rule ("# ----") belongs to no line
            while row in comment_at and lines[row - 1].lstrip().startswith("#") \
                    and not comment_at[row].startswith("-"):
                above.insert(0, comment_at[row])
                row -= 1
            comment = " ".join(above) or None
        if comment:
            found[match.group(2)] = comment
    return found


def defined(module) -> set[str]:
    """Names a module assigns at top level (not those it imports)."""
    return {target.id for node in ast.parse(inspect.getsource(module)).body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)}


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# types


def named_types() -> dict[tuple, str]:
    """Annotated aliases of schemas (RequestId, TokenIds, ...) by their metadata."""
    names = {}
    for module in (arrays, *MESSAGE_MODULES):
        for name, value in vars(module).items():
            if typing.get_origin(value) is typing.Annotated and not name.startswith("_"):
                names.setdefault(tuple(value.__metadata__), name)
    return names


NAMED = named_types()


BOUNDS = ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "<="),
          (annotated_types.Lt, "lt", "<"), (annotated_types.MinLen, "min_length", "length >="),
          (annotated_types.MaxLen, "max_length", "length <="))


def constraint_text(metadata: list) -> str:
    parts = []
    for item in metadata:
        bound = next(((attr, sign) for kind, attr, sign in BOUNDS if isinstance(item, kind)), None)
        if bound is not None:
            parts.append(f"{bound[1]} {getattr(item, bound[0])}")
        elif type(item).__name__ == "AllowInfNan" and not item.allow_inf_nan:
            parts.append("finite")
        elif isinstance(item, StringConstraints):
            parts += [f"{key.replace('_', ' ')} {value}" for key, value in
                      (("min_length", item.min_length), ("max_length", item.max_length), ("pattern", item.pattern))
                      if value is not None]
        elif isinstance(item, FieldInfo):
            parts.append(constraint_text(item.metadata))
        elif isinstance(item, Packed):
            values = f", values: {item.values}" if item.values else ""
            parts.append(f"{'/'.join(item.dtypes)}, {item.ndim}-d{values}")
        elif callable(getattr(item, "func", None)):  # an AfterValidator and the like
            parts.append(f"checked by `{item.func.__name__}`")
    return ", ".join(part for part in parts if part)


def type_text(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        name = NAMED.get(tuple(annotation.__metadata__))
        return name or type_text(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(arg) for arg in args)
    if origin is typing.Literal:
        return " | ".join(f'"{arg}"' for arg in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_text(arg) for arg in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is np.ndarray:
        return "array"
    if inspect.isclass(annotation) and issubclass(annotation, Enum):
        return f"[{annotation.__name__}](#errors)"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def field_type(info: FieldInfo) -> tuple[str, str]:
    """(type, constraints) of a field; a named alias swallows its own constraints."""
    name = NAMED.get(tuple(info.metadata))
    if name:
        return name, ""
    return type_text(info.annotation), constraint_text(info.metadata)


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()
        if isinstance(value, BaseModel):
            return "all defaults"
        return "[]" if isinstance(value, (list, np.ndarray)) else repr(value)
    value = info.default
    return f'"{value}"' if isinstance(value, str) else repr(value)


# ---------------------------------------------------------------------------------------------
# blocks


# "name: text." or "a / b [n, N]: text." at the start of a docstring sentence
DOC_FIELD = re.compile(r"(?:^|(?<=\. )|(?<=: ))(\w+(?: / \w+)*)(?: \[[^\]]*\])?: (.+?\.)(?= |$)")


def docstring_notes(klass: type) -> dict[str, str]:
    """name -> the sentence a class docstring starts with `name:` (the style of the models in schemas/)."""
    notes: dict[str, str] = {}
    for match in DOC_FIELD.finditer(" ".join((inspect.getdoc(klass) or "").split())):
        for name in match.group(1).split(" / "):
            notes.setdefault(name, match.group(2))
    return notes


def model_table(model: type[BaseModel]) -> str:
    """A model's fields; notes: the field's description, else its source comment, else the
    sentence of the class docstring that starts with its name."""
    notes = {}
    for klass in reversed(model.__mro__):
        if inspect.isclass(klass) and issubclass(klass, BaseModel) and klass.__module__ in MODEL_MODULE_NAMES:
            notes.update(docstring_notes(klass))
            notes.update(source_comments(klass))
    rows = []
    for name, info in model.model_fields.items():
        kind, constraints = field_type(info)
        rows.append((f"`{name}`", kind, constraints, default_text(info), info.description or notes.get(name, "")))
    return table(("field", "type", "constraints", "default", "notes"), rows)


def reachable_models() -> list[type[BaseModel]]:
    """Every pydantic model a message on the bus can contain, messages first, in MESSAGE_TYPES order."""
    found: list[type[BaseModel]] = []

    def visit(annotation) -> None:
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            if annotation not in found:
                found.append(annotation)
                for info in annotation.model_fields.values():
                    visit(info.annotation)
        for arg in typing.get_args(annotation):
            visit(arg)

    for message in MESSAGE_TYPES.values():
        visit(message)
    return found


def subjects_table() -> str:
    sample = Subjects("P")
    rows = []
    for name, member in vars(Subjects).items():
        if name.startswith("_") or not (isinstance(member, property) or inspect.isfunction(member)):
            continue
        if isinstance(member, property):
            subject = getattr(sample, name)
        else:
            params = list(inspect.signature(member).parameters)[1:]
            subject = member(sample, *(f"ARG{i}" for i in range(len(params))))
            for i, param in enumerate(params):
                subject = subject.replace(f"ARG{i}", f"<{param}>")
        if not subject.startswith(sample.prefix + "."):
            continue  # a helper, not a subject
        if name not in SUBJECT_ROUTES:
            raise SystemExit(f"Subjects.{name} (schemas/bus/subjects.py) has no row in SUBJECT_ROUTES "
                             f"(schemas/doc_tables.py): say who publishes it, who reads it and what")
        if SUBJECT_ROUTES[name] is None:
            continue
        sender, receiver, message, delivery = SUBJECT_ROUTES[name]
        pattern = "<p>" + subject[len(sample.prefix):]
        rows.append((f"`{pattern}`", sender, receiver, f"[{message}](#{message.lower()})", delivery))
    return table(("subject", "from", "to", "message", "delivery"), rows)


def errors_table() -> str:
    comments = source_comments(ErrorCode)
    return table(("code", "meaning"), [(f"`{code.value}`", comments.get(code.name, "")) for code in ErrorCode])


def limits_table() -> str:
    rows = []
    for module, listed in LIMITS:
        comments, names = source_comments(module), defined(module) if listed is None else set(listed)
        for name, value in vars(module).items():
            if re.fullmatch(r"[A-Z][A-Z0-9_]+", name) and name in names \
                    and isinstance(value, (int, float, str, tuple)) and not isinstance(value, (bool, Enum)):
                shown = ", ".join(f"`{v}`" for v in value) if isinstance(value, tuple) else f"`{value}`"
                rows.append((f"`{module.__name__}.{name}`", shown, comments.get(name, "")))
    return table(("name", "value", "notes"), rows)


def types_table() -> str:
    rows = []
    for module in (arrays, *MESSAGE_MODULES):
        comments, names = source_comments(module), defined(module)
        for name, value in vars(module).items():
            if name in names and NAMED.get(tuple(getattr(value, "__metadata__", ()))) == name:
                base = typing.get_args(value)[0]
                shown = "packed array" if base is np.ndarray else type_text(base)
                rows.append((f"`{name}`", shown, constraint_text(list(value.__metadata__)), comments.get(name, "")))
    return table(("type", "base", "constraints", "notes"), rows)


TABLES = {"subjects": subjects_table, "errors": errors_table, "limits": limits_table, "types": types_table}


def render(name: str, models: dict[str, type[BaseModel]], placed: set[str]) -> str:
    """One block's content; models: every reachable model by name, placed: those with a block."""
    if name in TABLES:
        return TABLES[name]()
    if name.startswith("model "):
        model_name = name.removeprefix("model ").strip()
        if model_name not in models:
            raise SystemExit(f"docs/PROTOCOL.md has a block for {model_name}, which no message contains")
        return model_table(models[model_name])
    if name == "other-models":
        return "".join(f"\n#### {model_name}\n\n{model_table(model)}" for model_name, model in models.items()
                       if model_name not in placed).lstrip("\n")
    raise SystemExit(f"unknown generated block {name!r} in docs/PROTOCOL.md")


def regenerate(text: str) -> str:
    models = {model.__name__: model for model in reachable_models()}
    placed = {m.group("name").removeprefix("model ").strip() for m in BLOCK.finditer(text)
              if m.group("name").startswith("model ")}
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("name").strip(), models, placed) + m.group(4), text)


def stale_blocks(text: str) -> list[str]:
    """Names of the generated blocks whose content differs from what the schemas produce."""
    fresh = {m.group("name"): m.group("body") for m in BLOCK.finditer(regenerate(text))}
    return [m.group("name") for m in BLOCK.finditer(text) if fresh[m.group("name")] != m.group("body")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale blocks (exit 1)")
    parser.add_argument("path", nargs="?", default=str(PROTOCOL_MD))
    args = parser.parse_args(argv)
    path = Path(args.path)
    text = path.read_text()
    if args.check:
        stale = stale_blocks(text)
        if stale:
            print(f"{path}: generated blocks out of date: {', '.join(stale)}; "
                  f"run `python -m schemas.doc_tables`", file=sys.stderr)
            return 1
        return 0
    new = regenerate(text)
    if new != text:
        path.write_text(new)
        print(f"{path}: regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
