"""Grammar masks as tensors, for the verifier (gpu_worker/verifier/verifier_grammar.py) and the
drafters (gpu_worker/drafter/drafter_core.py), which restrict the same law
(docs/PROTOCOL.md#structured-outputs): a slot owner's compiled grammars, llguidance's bitmasks
unpacked, logits masked."""

from __future__ import annotations

import time

import numpy as np
import structlog
import torch
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from schemas.generation import StructuredOutputs
from text.grammar import Grammars, OutputMatcher, llg_tokenizer
from text.tokenizer import load_tokenizer

log = structlog.get_logger(__name__)

def grammars_of(owner, vocab_size: int) -> Grammars:
    """owner's compiled grammars (a slot owner with tokenizer_dir and grammars), made on first
    use over a vocabulary of vocab_size ids (an owner that never sees a grammar loads no tokenizer)."""
    if owner.grammars is None:
        owner.grammars = Grammars(llg_tokenizer(load_tokenizer(owner.tokenizer_dir), vocab_size))
    return owner.grammars


def warm_grammars(owner, vocab_size: int) -> None:
    """Make owner's grammars now and compile one (the tokenizer's grammar view is the costly
    part), so the first request with a grammar pays none of it; a service calls it before it
    heartbeats. A tokenizer llguidance cannot read is logged once here (a row with a grammar
    then fails alone)."""
    started = time.monotonic()
    try:
        grammars_of(owner, vocab_size).matcher(StructuredOutputs(json_object=True))
    except Exception as exc:
        owner.grammars = None
        log.warning("grammars_unavailable", error=f"{type(exc).__name__}: {exc}")
        return
    log.info("grammars_warmed", seconds=round(time.monotonic() - started, 3))


def unpack(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (n, ceil(V/32)) int32, bit j of word w = token 32w + j -> (n, V) bool.
    In numpy (unpackbits over the words' little-endian bytes), as the masks below: a step's mask
    is one V-sized pass, which a torch op may hand to its thread pool, and waking the pool on a
    busy CPU costs more than the pass."""
    words = np.ascontiguousarray(bitmask, dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


def allowed_now(matcher: OutputMatcher, vocab_size: int) -> torch.Tensor:
    """(V,) bool: the tokens the grammar allows next."""
    bitmask = allocate_token_bitmask(1, vocab_size)
    fill_next_token_bitmask(matcher.matcher, bitmask, 0)
    return unpack(bitmask, vocab_size)[0]


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits (T, V) with the tokens outside allowed (T, V) bool at -inf."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def mask_logits_(logits: torch.Tensor, allowed: torch.Tensor) -> None:
    """mask_logits in place: numpy's where-copy for CPU float32 logits (unpack's reason), else
    torch's masked_fill_."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and allowed.device.type == "cpu":
        np.copyto(logits.numpy(), np.float32(-np.inf), where=~allowed.numpy())
    else:
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
