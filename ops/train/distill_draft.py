"""Distil the shipped draft for SmolLM2-135M-Instruct (models/smollm2-draft) from the target itself.

    python ops/train/distill_draft.py data  --threads 1       # the target answers 704 chat and code prompts
    python ops/train/distill_draft.py train --threads 1       # distil the draft (--resume continues)
    python ops/train/distill_draft.py eval  --threads 1       # held-out acceptance and cost ratio
    python ops/train/distill_draft.py export                  # export the last checkpoint again

--target DIR: the HF-layout directory of the target, default where `specbus models pull` puts
it. `all` runs data, train and eval in order; `train --follow` starts while `data` still runs.
Work files (generations, checkpoints) go to .train/smollm2-draft/; the draft is exported to
models/smollm2-draft/ at every checkpoint, so an interrupted run still leaves a usable draft. The seed is fixed; CUDA is used when present.

Design (the reasons are in models/README.md):
- Data: self-distillation. The target answers PROMPTS (chat questions built from templates and
  subjects, and programming tasks), wrapped in its ChatML chat template with the template's
  default system prompt, as `specbus generate --chat` does. 3 of every 4 answers are greedy, the
  rest sampled at temperature 0.8, top-p 0.95 (the bench's sampled setting), up to
  MAX_NEW_TOKENS each. Generation uses specbus's own runtime (gpu_worker.runtime.model.forward, slot KV
  cache, batched), and keeps the target's TOP_K most likely next tokens and their
  log-probabilities at every answer position: the labels. Prompts whose subject hashes into the
  held-out tenth are never trained on; acceptance is measured on their answers.
- Draft: LlamaForCausalLM with the target's width (hidden 576, 9 / 3 heads), DRAFT_LAYERS layers
  started from target layers LAYER_SOURCES, the target's final norm (rescaled: `calibrate_norm`),
  and a reduced vocabulary of DRAFT_VOCAB ids with tied input/output embeddings that are the
  target's rows and stay frozen: the DRAFT_VOCAB - 1 target tokens most frequent in the training
  generations (`draft_vocabulary`) plus one input-only "other" id for every other target token
  (d2t.safetensors maps draft ids to target ids; gpu_worker/runtime/checkpoint.py).
- Loss, on answer positions only (the drafter only ever drafts answers): cross-entropy on the
  target's greedy token (what greedy acceptance checks) plus KL(target top-k || draft), the
  top-k renormalised and mapped into the draft vocabulary, the mass of ids outside it on
  "other" (never proposed: its logit is -inf when drafting).
- Training runs in float32 on CPUs without native bf16 (AVX2 only: bf16 matmuls are emulated
  and slower) and in bf16 autocast on CUDA; AdamW, warmup then cosine decay, batches of whole
  examples padded on the right (causal, so padding never changes earlier positions).
"""

import argparse
import hashlib
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from text.chat_template import render_chat
from gpu_worker.runtime.checkpoint import load_d2t, load_model, save_d2t
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from gpu_worker.sampling.sampler import SamplingTensors, make_uniforms, sample
from text.tokenizer import load_tokenizer
from schemas.config import default_target_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_models import forward_ms  # noqa: E402
from train_models import lr_at  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "models" / "smollm2-draft"
WORK = REPO / ".train" / "smollm2-draft"
SEED = 1234
MAX_NEW_TOKENS = 160
TOP_K = 16             # target labels kept per answer position
SAMPLED_EVERY = 4      # one answer in four is sampled (temperature 0.8, top-p 0.95)
DRAFT_VOCAB = 8192     # 8191 most frequent target tokens + "other"
DRAFT_LAYERS = 2
LAYER_SOURCES = (0, 1)  # the target's first two layers: layer 1 reads what layer 0 writes
NORM_SCALES = (1.0, 0.5, 0.35, 0.25, 0.18, 0.125)
NORM_CALIBRATION_ANSWERS = 16
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# ---------------------------------------------------------------------------------------------
# prompts

SUBJECTS = [
    "photosynthesis", "gravity", "black holes", "the water cycle", "DNA", "vaccines", "inflation",
    "the French Revolution", "the Roman Empire", "climate change", "volcanoes", "earthquakes",
    "the moon", "the Internet", "electricity", "magnetism", "the immune system", "sleep",
    "coffee", "tea", "bread baking", "chess", "the piano", "jazz", "the Renaissance",
    "democracy", "the stock market", "compound interest", "recycling", "solar power",
    "wind turbines", "nuclear energy", "the human heart", "the brain", "bees", "whales",
    "rainforests", "deserts", "the ocean tides", "rainbows", "the seasons", "time zones",
    "the printing press", "ancient Egypt", "the Great Wall of China", "the Olympic Games",
    "football", "marathon running", "yoga", "meditation", "healthy eating", "vitamins",
    "machine learning", "neural networks", "encryption", "passwords", "cloud computing",
    "smartphones", "batteries", "electric cars", "airplanes", "rockets", "Mars", "the Sun",
    "stars", "galaxies", "the speed of light", "atoms", "chemical reactions", "acids and bases",
    "evolution", "dinosaurs", "fossils", "languages", "grammar", "poetry", "Shakespeare",
    "photography", "painting", "gardening", "composting", "dogs", "cats", "birds migrating",
    "public speaking", "job interviews", "time management", "budgeting", "saving money",
    "learning a new language", "writing an essay", "friendship", "kindness", "teamwork",
]
CHAT_TEMPLATES = [
    "What is {s}?", "Explain {s} in simple terms.", "Tell me three facts about {s}.",
    "Why is {s} important?", "Write a short paragraph about {s}.", "How does {s} work?",
    "Give me a fun fact about {s}.", "Explain {s} to a ten-year-old.",
    "Write a haiku about {s}.", "What are the pros and cons of {s}?",
]
QUESTIONS = [
    "What is the capital of France?", "What is 2 plus 2?", "What is the chemical symbol for gold?",
    "Who wrote Romeo and Juliet?", "How many days are in a leap year?", "What is the largest planet?",
    "How many continents are there?", "What is the boiling point of water?",
    "Who painted the Mona Lisa?", "What is the square root of 81?", "Name three primary colors.",
    "What language is spoken in Brazil?", "How many legs does a spider have?",
    "What is the tallest mountain in the world?", "What is the freezing point of water in Fahrenheit?",
    "Give me a synonym for happy.", "Translate 'good morning' into Spanish.",
    "What is 15 times 3?", "What year did the first person walk on the moon?",
    "Suggest a name for a pet goldfish.", "Write a short thank-you note to a teacher.",
    "Give me a recipe for pancakes.", "Plan a one-day trip to a big city.",
    "What should I pack for a beach holiday?", "How can I fall asleep faster?",
    "Write a limerick about a cat.", "Tell me a joke about computers.",
    "What are some good habits for students?", "How do I make a cup of tea?",
    "Describe a sunset in two sentences.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "computes the factorial of a number", "sorts a list with bubble sort",
    "finds the largest element of a list", "counts the vowels in a string",
    "checks whether a string is a palindrome", "merges two sorted lists",
    "removes duplicates from a list", "computes the average of a list of numbers",
    "converts Celsius to Fahrenheit", "returns the greatest common divisor of two integers",
    "flattens a nested list", "counts the words in a sentence", "implements binary search",
    "reads a text file and prints its lines", "returns the sum of the digits of an integer",
    "checks whether two strings are anagrams", "finds the second smallest number in a list",
    "converts a decimal number to binary", "capitalizes the first letter of every word",
    "returns the intersection of two lists", "generates a random password",
    "computes the area of a circle", "transposes a matrix", "validates an email address",
    "counts how often each character occurs in a string", "rotates a list by k positions",
    "returns the median of a list",
]
CODE_TEMPLATES = [
    "Write a Python function that {s}.", "Write a JavaScript function that {s}.",
    "How do I write a Python program that {s}?", "Write a function in C that {s}.",
    "Show me Python code that {s}, with a short explanation.",
]


def prompts() -> list[tuple[str, str]]:
    """(subject, user message) pairs, in a fixed order: templates x subjects, plain questions,
    code templates x tasks. The subject decides the held-out split."""
    chat = [(s, t.format(s=s)) for s, t in itertools.product(SUBJECTS, CHAT_TEMPLATES)]
    code = [(s, t.format(s=s)) for s, t in itertools.product(CODE_TASKS, CODE_TEMPLATES)]
    return chat + [(q, q) for q in QUESTIONS] + code


def held_out(subject: str) -> bool:
    return int(hashlib.sha1(subject.encode()).hexdigest(), 16) % 10 == 0


def held_out_chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """Token ids of `count` held-out prompts (never trained on) in the chat template, chat and
    code mixed (seeded shuffle): what ops/bench/bench_pipeline.py --chat sends."""
    items = [message for subject, message in prompts() if held_out(subject)]
    picked = random.Random(SEED).sample(items, len(items))[:count]
    if len(picked) < count:
        raise ValueError(f"only {len(picked)} held-out chat prompts, {count} asked")
    return [chat_ids(tokenizer, message) for message in picked]


def chat_ids(tokenizer, message: str) -> list[int]:
    """The target's chat template (its default system prompt) around one user message, ready
    for the assistant's answer: what the scheduler sends for `messages=[...]`."""
    return tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": message}]))


# ---------------------------------------------------------------------------------------------
# data: the target's answers and its top-k labels


@torch.inference_mode()
def generate_batch(model, config, rows: list[list[int]], sampled: list[bool], seeds: list[int],
                   eos_id: int, device: str) -> list[dict]:
    """Answer each prompt (ids) with the target; per answer token also its top-k labels.

    Returns per row {"ids": prompt + answer ids, "prompt_len": int, "topk_ids": (N, TOP_K)
    int32, "topk_logprobs": (N, TOP_K) float16}, N = answer length: row t holds the target's
    distribution for answer token t (its greedy token is topk_ids[t, 0]).
    """
    B = len(rows)
    lengths = torch.tensor([len(r) for r in rows])
    cache = KVCache(config, max_slots=B, max_seq_len=int(lengths.max()) + MAX_NEW_TOKENS + 1,
                    device=device, dtype=model.embed.dtype)
    slots = torch.tensor([cache.allocate() for _ in range(B)])
    tokens = torch.zeros(B, int(lengths.max()), dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = torch.tensor(r)
    logits = forward(model, cache, slots, tokens, lengths, logits_index=(lengths - 1).view(B, 1))
    params = SamplingTensors.build([0.8 if s else 0.0 for s in sampled], top_p=[0.95 if s else 1.0 for s in sampled],
                                   device=device)
    seed_t = torch.tensor(seeds)
    steps = []  # per step: (rows still answering (A,), their top-k ids (A, K), log-probs (A, K), next ids (A,))
    active = torch.arange(B)
    for step in range(MAX_NEW_TOKENS):
        logprobs = logits[:, -1].float().log_softmax(-1)                      # (A, V)
        top_lp, top_ids = logprobs.topk(TOP_K, -1)
        uniforms = make_uniforms(seed_t[active], (lengths[active] + step).view(-1, 1), stream=0)
        _, next_ids = sample(logits[:, -1:].float(), params.index(active.to(device)), uniforms.to(device))
        next_ids = next_ids[:, 0].cpu()
        steps.append((active, top_ids.cpu(), top_lp.cpu(), next_ids))
        going = next_ids != eos_id
        active, next_ids = active[going], next_ids[going]
        if not len(active):
            break
        # finished rows leave the batch: later steps cost only what is still answering
        logits = forward(model, cache, slots[active], next_ids.view(-1, 1), torch.ones(len(active), dtype=torch.long))
    out = []
    for b in range(B):
        picks = [(ids[who == b], lp[who == b], nxt[who == b]) for who, ids, lp, nxt in steps if bool((who == b).any())]
        out.append({"ids": rows[b] + [int(p[2]) for p in picks], "prompt_len": len(rows[b]),
                    "topk_ids": torch.cat([p[0] for p in picks]).int(),
                    "topk_logprobs": torch.cat([p[1] for p in picks]).half()})
    return out


def make_data(target: Path, batch: int, num_prompts: int, device: str) -> None:
    """Generate the answers of the first num_prompts prompts (0: all) of a seeded shuffle into
    WORK/data-*.safetensors shards, one per batch; existing shards are kept, so an interrupted
    run resumes, and a larger num_prompts later adds shards."""
    tokenizer = load_tokenizer(target)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, config = load_model(target, device=device, dtype=dtype, max_seq_len=1024)
    items = prompts()
    encoded = [chat_ids(tokenizer, message) for _, message in items]
    # A seeded shuffle, so the first N shards are a random sample of every kind of prompt (`train
    # --shards N` uses them); prompts are short next to answers, so padding them costs little.
    order = random.Random(SEED).sample(range(len(items)), len(items))[:num_prompts or None]
    WORK.mkdir(parents=True, exist_ok=True)
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    bar = tqdm(batches, desc="generate", unit="batch")
    for n, indices in enumerate(bar):
        shard = WORK / f"data-{n:04d}.safetensors"
        if shard.exists():
            continue
        results = generate_batch(model, config, [encoded[i] for i in indices],
                                 [i % SAMPLED_EVERY == SAMPLED_EVERY - 1 for i in indices],
                                 [SEED + i for i in indices], tokenizer.eos_ids[0], device)
        tensors, meta = {}, []
        for i, r in zip(indices, results):
            tensors[f"{i}.ids"] = torch.tensor(r["ids"], dtype=torch.int32)
            tensors[f"{i}.topk_ids"] = r["topk_ids"]
            tensors[f"{i}.topk_logprobs"] = r["topk_logprobs"]
            meta.append({"index": i, "subject": items[i][0], "prompt_len": r["prompt_len"],
                         "sampled": i % SAMPLED_EVERY == SAMPLED_EVERY - 1})
        save_file(tensors, str(shard), metadata={"rows": json.dumps(meta)})
        bar.set_postfix(tokens=sum(len(r["topk_ids"]) for r in results))


def load_examples() -> tuple[list[dict], list[dict]]:
    """(train, held_out) examples from the data shards, in prompt order."""
    from safetensors import safe_open

    examples = []
    for shard in sorted(WORK.glob("data-*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for row in json.loads(f.metadata()["rows"]):
                i = row["index"]
                examples.append(dict(row, ids=f.get_tensor(f"{i}.ids").long(),
                                     topk_ids=f.get_tensor(f"{i}.topk_ids").long(),
                                     topk_logprobs=f.get_tensor(f"{i}.topk_logprobs").float()))
    if not examples:
        raise SystemExit(f"no generations in {WORK}: run `python ops/train/distill_draft.py data` first")
    examples.sort(key=lambda e: e["index"])
    return [e for e in examples if not held_out(e["subject"])], [e for e in examples if held_out(e["subject"])]


# ---------------------------------------------------------------------------------------------
# draft


def draft_vocabulary(examples: list[dict], target_vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(d2t (DRAFT_VOCAB,), t2d (target_vocab,), other_id): the target tokens most frequent in the
    training examples (prompts and answers), counting also the target's top-k candidates at every
    answer position with their probabilities, so tokens the target nearly chose get ids too
    (ties by id). The last draft id is "other": every other target id maps to it on input, and
    its d2t entry (target id 0) is never proposed."""
    counts = torch.zeros(target_vocab, dtype=torch.float64)
    for e in examples:
        counts += torch.bincount(e["ids"], minlength=target_vocab)
        counts += torch.bincount(e["topk_ids"].flatten(), e["topk_logprobs"].double().exp().flatten(),
                                 minlength=target_vocab)
    kept = torch.argsort(counts, descending=True, stable=True)[:DRAFT_VOCAB - 1]
    other_id = DRAFT_VOCAB - 1
    t2d = torch.full((target_vocab,), other_id, dtype=torch.long)
    t2d[kept] = torch.arange(DRAFT_VOCAB - 1)
    return torch.cat([kept, torch.tensor([0])]), t2d, other_id


def new_draft(target: Path, d2t: torch.Tensor):
    """The draft as a transformers LlamaForCausalLM, started from the target's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = json.loads((target / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_parameters", "max_position_embeddings", "bos_token_id", "eos_token_id")
    config = LlamaConfig(**{k: hf[k] for k in keep if k in hf}, vocab_size=DRAFT_VOCAB,
                         num_hidden_layers=DRAFT_LAYERS, tie_word_embeddings=True)
    config.architectures = ["LlamaForCausalLM"]
    draft = LlamaForCausalLM(config)
    weights = load_file(str(next(target.glob("*.safetensors"))))
    state = {"model.embed_tokens.weight": weights["model.embed_tokens.weight"][d2t],
             "model.norm.weight": weights["model.norm.weight"]}
    for mine, source in enumerate(LAYER_SOURCES):
        prefix = f"model.layers.{source}."
        state.update({f"model.layers.{mine}." + k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
    missing, unexpected = draft.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    draft.tie_weights()
    return draft


def batch_tensors(examples: list[dict], t2d: torch.Tensor, other_id: int, device: str):
    """Right-padded inputs (B, T) in draft ids, and per answer position (row, column) its
    greedy label (draft id) and top-k teacher distribution over draft ids (N, DRAFT_VOCAB)."""
    T = max(len(e["ids"]) - 1 for e in examples)
    inputs = torch.full((len(examples), T), other_id, dtype=torch.long)
    rows, cols, labels, teacher = [], [], [], []
    for b, e in enumerate(examples):
        ids, p = e["ids"], e["prompt_len"]
        inputs[b, :len(ids) - 1] = t2d[ids[:-1]]
        n = len(ids) - p                      # answer tokens; position p-1+t predicts answer token t
        rows.append(torch.full((n,), b))
        cols.append(torch.arange(p - 1, p - 1 + n))
        labels.append(t2d[e["topk_ids"][:, 0]])
        probs = e["topk_logprobs"].softmax(-1)  # renormalised top-k
        teacher.append(torch.zeros(n, DRAFT_VOCAB).scatter_add_(1, t2d[e["topk_ids"]], probs))
    to = lambda t: torch.cat(t).to(device)  # noqa: E731
    return inputs.to(device), to(rows), to(cols), to(labels), to(teacher)


def export(draft, target: Path, d2t, t2d, other_id: int) -> None:
    """models/smollm2-draft: config.json, model.safetensors (bf16: half the file; the runtime
    converts to its dtype at load), d2t.safetensors and the target's tokenizer files (the
    drafter checks the tokenizer against the target's by hash)."""
    import copy
    import shutil

    OUT.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(draft).to(torch.bfloat16).save_pretrained(OUT, safe_serialization=True)
    save_d2t(OUT, d2t, t2d, other_id)
    for name in COPIED_FILES:
        if (target / name).exists():
            shutil.copyfile(target / name, OUT / name)


def start_draft(target: Path, resume: bool):
    """(draft started from the target, d2t, t2d, other_id, checkpoint or None). The vocabulary
    comes from the checkpoint when resuming (the data may have grown since), else from the
    training examples present now."""
    torch.manual_seed(SEED)
    ckpt_path = WORK / "draft.pt"
    ckpt = torch.load(ckpt_path, weights_only=False) if resume and ckpt_path.exists() else None
    if ckpt is not None:
        d2t, t2d, other_id = ckpt["d2t"], ckpt["t2d"], ckpt["other_id"]
    else:
        target_vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        d2t, t2d, other_id = draft_vocabulary(load_examples()[0], target_vocab)
    draft = new_draft(target, d2t)
    if ckpt is not None:
        draft.load_state_dict(ckpt["model"])
    else:
        calibrate_norm(draft, load_examples()[0][:NORM_CALIBRATION_ANSWERS], t2d, other_id)
    return draft, d2t, t2d, other_id, ckpt


@torch.no_grad()
def calibrate_norm(draft, examples: list[dict], t2d: torch.Tensor, other_id: int) -> None:
    """Scale the final norm's weight by the factor in NORM_SCALES with the lowest loss on a few
    answers. The target's final norm is made for the residual stream after 30 layers; after two,
    it gives logits several times too large (the losses per scale: models/README.md), and Adam
    would need thousands of steps of lr-sized moves to shrink 576 norm weights that far."""
    inputs, rows, cols, labels, _ = batch_tensors(examples, t2d, other_id, "cpu")
    hidden = draft.model(input_ids=inputs).last_hidden_state[rows, cols]
    losses = {scale: F.cross_entropy(draft.lm_head(hidden * scale), labels).item() for scale in NORM_SCALES}
    best = min(losses, key=losses.get)
    draft.model.norm.weight.mul_(best)
    print(f"final norm scaled by {best} (cross-entropy {losses[1.0]:.2f} -> {losses[best]:.2f})", flush=True)


def export_checkpoint(target: Path) -> None:
    """Export WORK/draft.pt again (e.g. with the tokenizer files of another copy of the target)."""
    draft, d2t, t2d, other_id, _ = start_draft(target, resume=True)
    export(draft, target, d2t, t2d, other_id)


def train(target: Path, steps: int, batch: int, peak_lr: float, kl_weight: float, resume: bool, follow: bool,
          device: str, save_every_s: float = 300.0) -> None:
    """Distil for `steps` steps of `batch` answers. follow: at every pass over the training
    answers, read the data shards again, so training can start while `data` still writes them
    (the vocabulary stays the one of the first shards)."""
    draft, d2t, t2d, other_id, ckpt = start_draft(target, resume)
    draft = draft.to(device)
    train_set, held = load_examples()
    answer_tokens = sum(len(e["topk_ids"]) for e in train_set)
    covered = sum(int((t2d[e["topk_ids"][:, 0]] != other_id).sum()) for e in train_set) / answer_tokens
    print(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params, {DRAFT_LAYERS} layers from "
          f"target layers {LAYER_SOURCES}, vocab {DRAFT_VOCAB} (covers {covered:.3f} of greedy answer tokens); "
          f"{len(train_set)} training answers ({answer_tokens} tokens), {len(held)} held out; "
          f"{steps} steps x {batch} answers", flush=True)
    # The tied embedding stays the target's: trained on a few hundred answers, its rows drifted
    # to fit them (held-out acceptance 0.26 where training batches reached 0.55), Adam moving a
    # row seen once as far as a frequent one. Frozen, it keeps the target's output space and
    # the work goes into the two layers and the norms.
    draft.model.embed_tokens.weight.requires_grad_(False)
    trained = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(SEED)
    start, epoch_order = 0, []  # epoch_order: prompt indices still to train on in this pass
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        rng.setstate(ckpt["rng"])
        start, epoch_order = ckpt["step"], ckpt["epoch_order"]
    by_index = {e["index"]: e for e in train_set}
    draft.train()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    last_save, ema = time.time(), None
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="distil")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup=min(100, steps // 10))
        if len(epoch_order) < batch:  # a new pass over the training answers, shuffled
            if follow:
                by_index = {e["index"]: e for e in load_examples()[0]}
            epoch_order = epoch_order + rng.sample(sorted(by_index), len(by_index))
        picked, epoch_order = epoch_order[:batch], epoch_order[batch:]
        inputs, rows, cols, labels, teacher = batch_tensors([by_index[i] for i in picked], t2d, other_id, device)
        with autocast:  # the head only at answer positions: the rest need no logits
            hidden = draft.model(input_ids=inputs).last_hidden_state[rows, cols]
            logits = draft.lm_head(hidden).float()                            # (N, DRAFT_VOCAB)
        logprobs = logits.log_softmax(-1)
        ce = F.nll_loss(logprobs, labels)
        kl = F.kl_div(logprobs, teacher, reduction="batchmean")
        loss = ce + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", acc=f"{(logits.argmax(-1) == labels).float().mean().item():.2f}",
                        answers=len(by_index))
        if time.time() - last_save > save_every_s or step + 1 == steps:
            torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "rng": rng.getstate(),
                        "step": step + 1, "epoch_order": epoch_order, "d2t": d2t, "t2d": t2d,
                        "other_id": other_id}, WORK / "draft.pt")
            export(draft, target, d2t, t2d, other_id)
            bar.write(f"step {step + 1}: held-out greedy acceptance {held_out_acceptance(draft, held, t2d, other_id):.3f}")
            last_save = time.time()


@torch.no_grad()
def held_out_acceptance(draft, held: list[dict], t2d: torch.Tensor, other_id: int) -> float:
    """Teacher-forced greedy acceptance of the training model on the held-out answers (the
    `eval` stage measures the exported draft with specbus's runtime)."""
    draft.eval()
    device = next(draft.parameters()).device
    hits = total = 0
    for i in range(0, len(held), 8):
        inputs, rows, cols, labels, _ = batch_tensors(held[i:i + 8], t2d, other_id, device)
        logits = draft.lm_head(draft.model(input_ids=inputs).last_hidden_state[rows, cols])
        logits[:, other_id] = -math.inf
        hits += int((logits.argmax(-1) == labels).sum())  # never "other": its logit is -inf
        total += len(labels)
    draft.train()
    return hits / max(1, total)


# ---------------------------------------------------------------------------------------------
# evaluation with specbus's runtime


@torch.inference_mode()
def acceptance(draft_dir: Path, examples: list[dict], dtype=torch.float32) -> dict:
    """Teacher-forced greedy acceptance on answers: the draft reads the prompt and the answer
    so far (target ids mapped by t2d) and its argmax, mapped by d2t, is compared with the
    target's greedy token at every answer position ("other" is never proposed)."""
    model, config = load_model(draft_dir, dtype=dtype, max_seq_len=1024)
    maps = load_d2t(draft_dir)
    hits = total = 0
    greedy_hits = greedy_total = 0
    for e in examples:
        ids, p = e["ids"], e["prompt_len"]
        cache = KVCache(config, max_slots=1, max_seq_len=len(ids), dtype=dtype)
        slot = torch.tensor([cache.allocate()])
        inputs = maps.t2d[ids[:-1]].view(1, -1)
        logits = forward(model, cache, slot, inputs, torch.tensor([inputs.shape[1]]))[0, p - 1:].float()
        logits[:, maps.other_id] = -math.inf
        match = (maps.d2t[logits.argmax(-1)] == e["topk_ids"][:, 0]).long()
        hits, total = hits + int(match.sum()), total + len(match)
        if not e["sampled"]:
            greedy_hits, greedy_total = greedy_hits + int(match.sum()), greedy_total + len(match)
    return {"answers": len(examples), "answer_tokens": total, "greedy_acceptance": round(hits / total, 4),
            "greedy_acceptance_on_greedy_answers": round(greedy_hits / max(1, greedy_total), 4)}


def evaluate(target: Path, dtypes: list[str], repeats: int, context: int) -> dict:
    _, held = load_examples()
    result = {"threads": torch.get_num_threads(), "context": context, **acceptance(OUT, held)}
    for name in dtypes:
        dtype = getattr(torch, name)
        draft_ms = forward_ms(OUT, context, 1, repeats, dtype)
        target_ms = forward_ms(target, context, 5, max(10, repeats // 10), dtype)
        result[name] = {"draft_1_token_ms": round(draft_ms, 3), "target_5_tokens_ms": round(target_ms, 2),
                        "cost_ratio": round(draft_ms / target_ms, 4)}
    result["weight_mb"] = round(sum(p.stat().st_size for p in OUT.glob("*.safetensors")) / 1e6, 2)
    (OUT / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["data", "train", "eval", "export", "all"])
    parser.add_argument("--target", type=Path, default=Path(default_target_model()),
                        help="HF-layout directory of SmolLM2-135M-Instruct (default: where `specbus models pull` puts it)")
    parser.add_argument("--gen-batch", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=704, help="answers to generate (0: every prompt)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=8, help="answers per training step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl-weight", type=float, default=1.0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--follow", action="store_true", help="train: read new data shards at every pass")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default; 1 = single-threaded)")
    parser.add_argument("--eval-dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    stages = ["data", "train", "eval"] if args.stage == "all" else [args.stage]
    for stage in stages:
        if stage == "data":
            make_data(args.target, args.gen_batch, args.prompts, device)
        elif stage == "export":
            export_checkpoint(args.target)
        elif stage == "train":
            train(args.target, args.steps, args.batch, args.lr, args.kl_weight, args.resume, args.follow, device)
        else:
            evaluate(args.target, args.eval_dtypes.split(","), args.repeats, args.context)


if __name__ == "__main__":
    main()
