"""Tokenizer loading and incremental detokenization. Torch-free: the postprocessor uses it.

Incremental detokenization follows the prefix/read-offset scheme of HF text-generation-
inference and vLLM: decode a short window of already-emitted tokens (the prefix) with and
without the new tokens and emit the difference, so tokenizers whose decoding of a token
depends on its left neighbour (byte-level BPE split characters, SentencePiece leading spaces)
stream the same text as one full decode. Text ending in U+FFFD (an incomplete UTF-8
sequence) is held back until later tokens complete it.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from schemas.errors import ErrorCode, SpecbusError

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class Tokenizer:
    """hf: the tokenizers object. chat_template: Jinja source, None when the model has none
    (text/chat_template.py renders it). special_tokens: {"bos_token": "<s>", ...} as the
    template sees them. path: the directory it came from (for error messages)."""
    hf: HFTokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    path: str = ""

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of text, without special tokens (no BOS is added)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Text of ids; special tokens (BOS/EOS, ...) are skipped."""
        return self.hf.decode(list(ids), skip_special_tokens=True)


def check_in_vocabulary(ids, vocab_size: int, field: str) -> None:
    """SpecbusError invalid_field naming `field` when a token id of ids (ints, a list or an
    array; ids are never negative: the schemas refuse that) is not below vocab_size. The one
    vocabulary check of the scheduler, the verifier and the drafter."""
    largest = max((int(i) for i in ids), default=-1) if not hasattr(ids, "max") else \
        (int(ids.max()) if len(ids) else -1)
    if largest >= vocab_size:
        raise SpecbusError(ErrorCode.invalid_field, f"token id {largest} is outside the vocabulary [0, {vocab_size})",
                           field)


def tokenizer_id(path) -> str:
    """The first 16 hex digits of the sha256 of path/tokenizer.json. Instances are paired only
    when these match (their heartbeats carry it as model_ids["tokenizer"])."""
    return hashlib.sha256((Path(path) / "tokenizer.json").read_bytes()).hexdigest()[:16]


def draft_misfit(target_dir, draft_dir) -> str | None:
    """Why a draft cannot serve a target, or None when it can: the scheduler pairs a drafter
    with a request only when their tokenizer.json hashes match (`tokenizer_id`), and a draft
    without a d2t map (d2t.safetensors) must share the target's vocabulary size."""
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    target_hash, draft_hash = tokenizer_id(target_dir), tokenizer_id(draft_dir)
    if target_hash != draft_hash:
        return (f"draft model {draft_dir} has another tokenizer than target model {target_dir} "
                f"(tokenizer.json {draft_hash} vs {target_hash}): the scheduler would never use it")
    target_vocab = _read_json(target_dir / "config.json").get("vocab_size")
    draft_vocab = _read_json(draft_dir / "config.json").get("vocab_size")
    if not (draft_dir / "d2t.safetensors").exists() and target_vocab != draft_vocab:
        return (f"draft model {draft_dir} has vocab_size {draft_vocab} and no d2t.safetensors map, target model "
                f"{target_dir} has vocab_size {target_vocab}")
    return None


def eagle_misfit(target_dir, head_dir) -> str | None:
    """Why an EAGLE head cannot serve a target, or None when it can: the head reads the target's
    features and its embedding as lm_head, so its hidden size and vocabulary must be the target's
    and the target must tie lm_head to its embedding (gpu_worker/runtime/eagle.py `head_misfit` checks
    the same of loaded configs)."""
    target_dir, head_dir = Path(target_dir), Path(head_dir)
    head, target = _read_json(head_dir / "eagle_config.json"), _read_json(target_dir / "config.json")
    wanted = (head.get("hidden_size"), head.get("target_vocab_size"))
    given = (target.get("hidden_size"), target.get("vocab_size"))
    if wanted != given:
        return (f"EAGLE head {head_dir} is for a target of hidden size {wanted[0]} and vocabulary {wanted[1]}; "
                f"target model {target_dir} has hidden size {given[0]} and vocabulary {given[1]}")
    if not target.get("tie_word_embeddings"):
        return f"EAGLE head {head_dir} needs a target with tied embeddings; target model {target_dir} has none"
    return None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _special_ids(hf: HFTokenizer, tokenizer_config: dict, other_configs: list[dict],
                 key: str) -> list[int]:
    """Ids for "bos"/"eos": tokenizer_config.json's token string wins, then the first of
    generation_config.json / config.json that sets `<key>_token_id` (an int or a list)."""
    token = _token_text(tokenizer_config.get(f"{key}_token"))
    if token is not None and hf.token_to_id(token) is not None:
        return [hf.token_to_id(token)]
    for config in other_configs:
        value = config.get(f"{key}_token_id")
        if value is not None:
            return list(value) if isinstance(value, list) else [value]
    return []


def _chat_template(path: Path, tokenizer_config: dict) -> str | None:
    """tokenizer_config.json's chat_template (a string, or a list of named ones: "default"),
    else chat_template.jinja (where transformers 5 saves it)."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return template


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token  # older files: {"content": "</s>", ...}


def load_tokenizer(path) -> Tokenizer:
    """Load path/tokenizer.json; bos/eos ids from tokenizer_config.json, else
    generation_config.json, else config.json (first file that names one wins); the chat
    template and special token strings from tokenizer_config.json."""
    path = Path(path)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer_config = _read_json(path / "tokenizer_config.json")
    others = [_read_json(path / "generation_config.json"), _read_json(path / "config.json")]
    bos = _special_ids(hf, tokenizer_config, others, "bos")
    special_tokens = {f"{key}_token": _token_text(tokenizer_config[f"{key}_token"])
                      for key in ("bos", "eos", "unk", "pad") if tokenizer_config.get(f"{key}_token")}
    return Tokenizer(hf=hf, bos_id=bos[0] if bos else None,
                     eos_ids=tuple(_special_ids(hf, tokenizer_config, others, "eos")),
                     chat_template=_chat_template(path, tokenizer_config), special_tokens=special_tokens,
                     path=str(path))


@dataclass
class DetokenizerState:
    """Plain data (msgpack: `dataclasses.asdict(state)` / `DetokenizerState(**d)`).

    ids: the tokens still needed: the emitted prefix window, then tokens not yet emitted.
        (vLLM's all_ids[prefix_offset:]; older tokens are dropped, so the state stays small.)
    read_offset: index in ids where the not-yet-emitted tokens begin.
    """
    ids: list[int] = field(default_factory=list)
    read_offset: int = 0


def new_detokenizer_state(context_ids=(), context_window: int = 5) -> DetokenizerState:
    """Start a stream after context_ids (e.g. the prompt); only its last tokens are kept, as
    the prefix that decides how the first new token renders."""
    ids = list(context_ids)[-context_window:] if context_window else []
    return DetokenizerState(ids=ids, read_offset=len(ids))


def detokenize_step(tokenizer: Tokenizer, state: DetokenizerState, new_ids,
                    final: bool = False) -> tuple[DetokenizerState, str]:
    """Append new_ids; return (new state, text delta). `state` is not modified.

    Text that ends in an incomplete UTF-8 character is held back; `final=True` (end of stream)
    flushes it as decode() would show it, U+FFFD included.
    """
    ids = state.ids + list(new_ids)
    prefix_text = tokenizer.decode(ids[:state.read_offset])
    text = tokenizer.decode(ids)
    if len(text) > len(prefix_text) and (final or not text.endswith(REPLACEMENT_CHAR)):
        return DetokenizerState(ids=ids[state.read_offset:], read_offset=len(ids) - state.read_offset), \
            text[len(prefix_text):]
    return DetokenizerState(ids=ids, read_offset=state.read_offset), ""
