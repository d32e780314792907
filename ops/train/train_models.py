"""Train the tiny model pair shipped in models/tiny/: a BPE tokenizer, a target model and a draft.

    python ops/train/train_models.py all          # tokenizer, target, draft, evaluation (hours on a CPU)
    python ops/train/train_models.py target --resume

Steps, each a subcommand (`all` runs them in order):
1. `tokenizer`: a byte-level BPE (vocabulary 4096) trained on the Python standard library's own
   source files (present on every machine with Python; `test`/`tests` directories and
   site-packages are left out). One file in 20, chosen by a hash of its path (`_held_out`), is held
   out for evaluation and never trained on.
2. `target`: a Llama-architecture decoder trained from scratch on the training files (next-token
   cross-entropy, AdamW, warmup then cosine decay). Checkpoints (model + optimizer) go to
   `.train/` every few minutes, so `--resume` continues an interrupted run; the HF-layout export
   goes to `models/tiny/target` (fp16 on disk, upcast at load).
3. `draft`: a DRAFT_LAYERS-layer decoder with a reduced vocabulary (the most frequent target
   tokens plus one "other" token standing for every target token outside it), distilled from the
   target: the loss is KL(target || draft) with the target's probability mass outside the draft
   vocabulary folded onto "other". It starts from the target: the embedding rows of its tokens,
   evenly spaced target layers (first and last) and the final norm. Exported to `models/tiny/draft`
   with `d2t.safetensors` (draft id -> target id, and the inverse map for inputs).
4. `eval`: held-out cross-entropy of both models and teacher-forced greedy acceptance (draft argmax
   mapped through d2t == target argmax), written to `models/eval.json`.

Training uses transformers' LlamaForCausalLM (a dev dependency); serving uses specbus's own
runtime in gpu_worker/, which loads the exported directories like any HF checkpoint. CUDA is used
when present; the seed is fixed.
"""

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
TINY = MODELS / "tiny"  # the pair this script makes
WORK = REPO / ".train"
EOS = "<|endoftext|>"
TARGET_VOCAB = 4096
DRAFT_VOCAB = 2048  # 2047 most frequent target tokens + "other"
SEQ_LEN = 256

TARGET_CONFIG = dict(
    hidden_size=192, intermediate_size=512, num_hidden_layers=10, num_attention_heads=3,
    num_key_value_heads=1, max_position_embeddings=2048, rope_theta=10000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=True,
)
DRAFT_LAYERS = 2  # two layers can form induction heads (copy what followed an earlier match)


def draft_config(num_layers: int) -> dict:
    return dict(TARGET_CONFIG, num_hidden_layers=num_layers)


def layer_sources(num_draft_layers: int, num_target_layers: int) -> list[int]:
    """Target layers the draft's layers start from: evenly spaced, first and last included
    (student initialised from a subset of the teacher's layers, as DistilBERT does)."""
    if num_draft_layers == 1:
        return [0]
    step = (num_target_layers - 1) / (num_draft_layers - 1)
    return [round(i * step) for i in range(num_draft_layers)]


def source_files() -> tuple[list[Path], list[Path]]:
    """Train and held-out .py files of this interpreter's standard library, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test"}
    files = sorted(p for p in stdlib.rglob("*.py") if not skip & set(p.relative_to(stdlib).parts))
    held_out = [p for p in files if _held_out(p.relative_to(stdlib).as_posix())]
    train = [p for p in files if p not in set(held_out)]
    return train, held_out


def _held_out(rel_path: str) -> bool:
    return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % 20 == 0


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train, _ = source_files()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True,
    )
    tok.train_from_iterator((read_text(p) for p in train), trainer=trainer, length=len(train))
    for name in ("target", "draft"):
        out = TINY / name
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": EOS, "eos_token": EOS, "model_max_length": 2048}, indent=2) + "\n")
    print(f"tokenizer: vocab {tok.get_vocab_size()} from {len(train)} files")


def token_stream(files: list[Path]) -> torch.Tensor:
    """All files encoded and joined by EOS: LongTensor [N]. Cached in .train/."""
    from tokenizers import Tokenizer

    key = hashlib.sha1("\n".join(str(p) for p in files).encode()).hexdigest()[:12]
    cache = WORK / f"tokens-{key}.pt"
    if cache.exists():
        return torch.load(cache)
    tok = Tokenizer.from_file(str(TINY / "target" / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([read_text(p) for p in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    tokens = torch.tensor(ids, dtype=torch.long)
    WORK.mkdir(exist_ok=True)
    torch.save(tokens, cache)
    return tokens


def random_windows(tokens: torch.Tensor, batch: int, gen: torch.Generator) -> torch.Tensor:
    """batch windows of SEQ_LEN + 1 tokens at random offsets: [batch, SEQ_LEN + 1]."""
    starts = torch.randint(0, len(tokens) - SEQ_LEN - 1, (batch,), generator=gen)
    return torch.stack([tokens[s:s + SEQ_LEN + 1] for s in starts.tolist()])


def eval_windows(tokens: torch.Tensor, max_windows: int = 64) -> torch.Tensor:
    """Non-overlapping held-out windows, [W, SEQ_LEN + 1], the same every run."""
    n = min(max_windows, (len(tokens) - 1) // SEQ_LEN)
    return torch.stack([tokens[i * SEQ_LEN:(i + 1) * SEQ_LEN + 1] for i in range(n)])


def llama(config: dict, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, **config)
    return LlamaForCausalLM(cfg)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def export(model, out: Path) -> None:
    """HF layout with fp16 weights (halves the files; the runtime upcasts at load)."""
    import copy

    half = copy.deepcopy(model).to(torch.float16)
    half.save_pretrained(out, safe_serialization=True)


def train_loop(name: str, model, loss_fn, tokens, steps: int, batch: int, peak_lr: float,
               resume: bool, device: str, save_every_s: float = 300.0) -> None:
    """AdamW over random windows; checkpoint to .train/<name>.pt; export to models/tiny/<name>."""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1234)
    ckpt_path = WORK / f"{name}.pt"
    start = 0
    if resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        gen.set_state(ckpt["gen"])
        start = ckpt["step"]
    model.train()
    last_save = time.time()
    ema = None
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=f"train {name}")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup=min(200, steps // 10))
        window = random_windows(tokens, batch, gen).to(device)
        loss = loss_fn(window)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
        if time.time() - last_save > save_every_s or step + 1 == steps:
            WORK.mkdir(exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "gen": gen.get_state(), "step": step + 1}, ckpt_path)
            export(model, TINY / name)
            last_save = time.time()
    model.eval()


def train_target(steps: int, batch: int, lr: float, resume: bool, device: str) -> None:
    torch.manual_seed(0)
    train, _ = source_files()
    tokens = token_stream(train)
    model = llama(TARGET_CONFIG, TARGET_VOCAB).to(device)
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{len(tokens)} training tokens, {steps} steps x {batch} x {SEQ_LEN}")

    def loss_fn(window):
        logits = model(input_ids=window[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())

    t0 = time.time()
    train_loop("target", model, loss_fn, tokens, steps, batch, lr, resume, device)
    print(f"target trained in {time.time() - t0:.0f} s")


def load_target(device: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(TINY / "target", dtype=torch.float32).to(device).eval()


def draft_vocabulary(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(d2t [DRAFT_VOCAB], t2d [TARGET_VOCAB], other_id): the most frequent target tokens.

    Draft ids 0..DRAFT_VOCAB-2 are target tokens in order of frequency; the last id is "other",
    which every target token outside the draft vocabulary maps to on input. Its d2t entry is the
    target's EOS; the drafter never proposes it, so that entry only keeps the map total.
    """
    counts = torch.bincount(tokens, minlength=TARGET_VOCAB)
    kept = torch.argsort(counts, descending=True, stable=True)[:DRAFT_VOCAB - 1]
    other_id = DRAFT_VOCAB - 1
    d2t = torch.cat([kept, torch.tensor([0])])
    t2d = torch.full((TARGET_VOCAB,), other_id, dtype=torch.long)
    t2d[kept] = torch.arange(DRAFT_VOCAB - 1)
    return d2t, t2d, other_id


def fold_to_draft(target_logits: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Target probabilities [..., V_target] summed into draft ids: [..., DRAFT_VOCAB]."""
    probs = target_logits.float().softmax(-1)
    out = torch.zeros(*probs.shape[:-1], DRAFT_VOCAB, device=probs.device)
    return out.index_add_(-1, t2d.to(probs.device), probs)


def train_draft(steps: int, batch: int, lr: float, resume: bool, device: str, num_layers: int) -> None:
    from gpu_worker.runtime.checkpoint import save_d2t

    torch.manual_seed(0)
    train, _ = source_files()
    tokens = token_stream(train)
    target = load_target(device)
    d2t, t2d, other_id = draft_vocabulary(tokens)
    draft = llama(draft_config(num_layers), DRAFT_VOCAB).to(device)
    with torch.no_grad():  # start from the target: its embeddings of the kept tokens, some of its layers
        emb = target.get_input_embeddings().weight
        draft.get_input_embeddings().weight[:-1] = emb[d2t[:-1].to(device)]
        sources = layer_sources(num_layers, len(target.model.layers))
        for layer, source in zip(draft.model.layers, sources):
            layer.load_state_dict(target.model.layers[source].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    t2d_dev = t2d.to(device)
    print(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params, "
          f"vocab {DRAFT_VOCAB}, {num_layers} layers from target layers {sources}, "
          f"distilling for {steps} steps x {batch} x {SEQ_LEN}")

    def loss_fn(window):
        inputs = window[:, :-1]
        with torch.no_grad():
            teacher = fold_to_draft(target(input_ids=inputs).logits, t2d_dev)
        logprobs = draft(input_ids=t2d_dev[inputs]).logits.log_softmax(-1)
        return F.kl_div(logprobs.flatten(0, 1), teacher.flatten(0, 1), reduction="batchmean")

    t0 = time.time()
    # d2t first, so every checkpoint export is a usable pair.
    (TINY / "draft").mkdir(parents=True, exist_ok=True)
    save_d2t(TINY / "draft", d2t, t2d, other_id)
    train_loop("draft", draft, loss_fn, tokens, steps, batch, lr, resume, device)
    print(f"draft distilled in {time.time() - t0:.0f} s")


@torch.no_grad()
def evaluate(device: str) -> dict:
    """Held-out CE of both models and teacher-forced greedy acceptance."""
    from transformers import LlamaForCausalLM

    from gpu_worker.runtime.checkpoint import load_d2t

    _, held_out = source_files()
    windows = eval_windows(token_stream(held_out)).to(device)
    target = load_target(device)
    draft = LlamaForCausalLM.from_pretrained(TINY / "draft", dtype=torch.float32).to(device).eval()
    maps = load_d2t(TINY / "draft")
    d2t, t2d = maps.d2t.to(device), maps.t2d.to(device)
    inputs, labels = windows[:, :-1], windows[:, 1:]
    target_logits = target(input_ids=inputs).logits
    draft_logits = draft(input_ids=t2d[inputs]).logits
    draft_logits[..., maps.other_id] = -math.inf  # never proposed
    result = {
        "held_out_files": len(held_out),
        "eval_tokens": labels.numel(),
        "target_ce": F.cross_entropy(target_logits.flatten(0, 1), labels.flatten()).item(),
        # Draft CE in target space is only defined on tokens inside the draft vocabulary.
        "draft_coverage": (t2d[labels] != maps.other_id).float().mean().item(),
        "greedy_acceptance": (d2t[draft_logits.argmax(-1)] == target_logits.argmax(-1))
        .float().mean().item(),
    }
    inside = t2d[labels] != maps.other_id
    draft_lp = draft_logits.log_softmax(-1).gather(-1, t2d[labels].unsqueeze(-1)).squeeze(-1)
    result["draft_ce_in_vocab"] = (-draft_lp[inside]).mean().item()
    result["target_ce_in_vocab"] = F.cross_entropy(
        target_logits[inside], labels[inside]).item()
    (MODELS / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["tokenizer", "target", "draft", "eval", "all"])
    parser.add_argument("--target-steps", type=int, default=1700)
    parser.add_argument("--draft-steps", type=int, default=1600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--draft-lr", type=float, default=2e-3)
    parser.add_argument("--draft-layers", type=int, default=DRAFT_LAYERS)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    stages = ["tokenizer", "target", "draft", "eval"] if args.stage == "all" else [args.stage]
    for stage in stages:
        if stage == "tokenizer":
            train_tokenizer()
        elif stage == "target":
            train_target(args.target_steps, args.batch, args.target_lr, args.resume, device)
        elif stage == "draft":
            train_draft(args.draft_steps, args.batch, args.draft_lr, args.resume, device, args.draft_layers)
        else:
            evaluate(device)


if __name__ == "__main__":
    main()
