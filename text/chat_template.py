"""Chat templates: a list of messages rendered into the prompt text a chat model was trained on.

Torch-free. The scheduler renders GenerateRequest.messages with it (so clients need no model
files), and an HTTP gateway can render /v1/chat/completions the same way:

    text = render_chat(load_tokenizer(target_dir), [{"role": "user", "content": "Hi"}])

Rendering follows transformers' `apply_chat_template` (the template's own language is Jinja, run
in jinja2's immutable sandbox: a template comes with a downloaded model and must not reach
Python objects): the environment has trim_blocks/lstrip_blocks and the loopcontrols extension,
`raise_exception` and `strftime_now` globals, a `tojson` filter that keeps non-ASCII characters,
and the template sees `messages`, `add_generation_prompt` and the special token strings
(`bos_token`, `eos_token`, ...). The text is then encoded without adding special tokens: a
template writes the ones it wants.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from text.tokenizer import Tokenizer, load_tokenizer


class ChatTemplateError(ValueError):
    """No chat template, or one that refused the messages (its own message says why)."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(tokenizer: Tokenizer | str | Path, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """The prompt text of messages ([{"role": ..., "content": ...}, ...]) under the chat template
    of tokenizer (a loaded Tokenizer, or a model directory). ChatTemplateError when there is no
    template, or when the template or the messages are malformed. tools: OpenAI's tool
    definitions, the template's `tools` variable (text/tool_calls.py renders them for a template
    without a tools section)."""
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    if not tokenizer.chat_template:
        raise ChatTemplateError("the model has no chat template (no `chat_template` in its "
                                "tokenizer_config.json, no chat_template.jinja); send a plain prompt instead")
    try:
        return compile_template(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **tokenizer.special_tokens)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template: {exc}") from None
