"""Export the draft with its reduced vocabulary expanded to the target's, so that Hugging Face
transformers assisted generation (`generate(assistant_model=...)`) can use it as the assistant.

    PYTHONPATH=. python ops/train/export_assistant_draft.py --draft models/tiny/draft --target models/tiny/target --out /tmp/assistant

The shipped draft speaks a reduced vocabulary: draft id d stands for target id d2t[d], and the
draft id `other_id` stands for every target token outside it (input only; the drafter never
proposes it). transformers needs an assistant over the target's ids, so the export writes a
LlamaForCausalLM with vocab_size = V_target and untied embeddings:

- input embeddings: row t = the draft's row t2d[t]. A target token outside the draft
  vocabulary is read as the draft reads it, as `other_id`;
- output rows (lm_head): row t = the draft's output row t2d[t] for every t the draft can
  propose, so those logits are exactly the draft's;
- output rows of the target ids the draft cannot propose: the MEAN of the proposable rows.
  Llama's lm_head has no bias, so no row can add a constant -inf; but a logit is linear in the
  final hidden state h, so this row's logit is the mean of the proposable logits at every h,
  which is below their maximum unless all of them are equal. Hence such a token never wins an
  argmax (greedy assisted generation proposes what the specbus drafter proposes); under
  sampling it keeps a small mass (measured by `check_expanded`: `max_outside_mass`).

Where d2t is many-to-one (several draft ids for one target id), the row of t2d[t] is used
(d2t[t2d[t]] == t), as the specbus drafter maps inputs. `check_expanded` runs both models on
token windows and reports how often the expanded model's argmax equals d2t of the draft's
argmax over its proposable ids (1.0 expected, up to exact float ties).
"""

import argparse
import json
import math
import shutil
from pathlib import Path

import torch

from gpu_worker.runtime.checkpoint import load_d2t
from ops.train.train_models import eval_windows, source_files, token_stream

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def load_hf(path, device: str = "cpu"):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


@torch.no_grad()
def export_assistant_draft(draft_dir, target_dir, out_dir) -> Path:
    """Write the expanded draft (module docstring) to out_dir with the target's tokenizer files."""
    from transformers import LlamaForCausalLM

    draft_dir, target_dir, out_dir = Path(draft_dir), Path(target_dir), Path(out_dir)
    draft = load_hf(draft_dir)
    maps = load_d2t(draft_dir)
    target_vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    if maps is None:  # already the target's vocabulary
        if draft.config.vocab_size != target_vocab:
            raise ValueError(f"draft vocab {draft.config.vocab_size} != target vocab {target_vocab} and no d2t map")
        expanded = draft
    else:
        if maps.target_vocab_size != target_vocab:
            raise ValueError(f"d2t maps to {maps.target_vocab_size} target ids, the target has {target_vocab}")
        proposable = maps.t2d != maps.other_id  # (V_target,)
        embed = draft.get_input_embeddings().weight  # (V_draft, D)
        head = draft.get_output_embeddings().weight  # (V_draft, D); the same tensor when tied
        new_head = head[maps.t2d[proposable]].mean(0).expand(target_vocab, -1).clone()  # (V_target, D)
        new_head[proposable] = head[maps.t2d[proposable]]
        config = draft.config
        config.vocab_size, config.tie_word_embeddings = target_vocab, False
        expanded = LlamaForCausalLM(config).eval()
        vocab_keys = ("model.embed_tokens.weight", "lm_head.weight")
        state = {k: v for k, v in draft.state_dict().items() if k not in vocab_keys}
        state["model.embed_tokens.weight"] = embed[maps.t2d]
        state["lm_head.weight"] = new_head
        expanded.load_state_dict(state, strict=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    expanded.save_pretrained(out_dir, safe_serialization=True)
    for name in COPIED_FILES:
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out_dir / name)
    return out_dir


@torch.no_grad()
def check_expanded(draft_dir, expanded_dir, windows: torch.Tensor) -> dict:
    """Both models over windows (W, T) of target ids: argmax agreement (expanded argmax ==
    d2t[draft argmax over proposable ids]) and the largest probability the expanded model puts
    on target ids the draft cannot propose."""
    maps = load_d2t(draft_dir)
    expanded_logits = load_hf(expanded_dir)(input_ids=windows).logits  # (W, T, V_target)
    if maps is None:
        draft_choice = load_hf(draft_dir)(input_ids=windows).logits.argmax(-1)
        outside_mass = torch.zeros(())
    else:
        draft_logits = load_hf(draft_dir)(input_ids=maps.t2d[windows]).logits  # (W, T, V_draft)
        draft_logits[..., maps.other_id] = -math.inf
        draft_choice = maps.d2t[draft_logits.argmax(-1)]
        outside = maps.t2d == maps.other_id
        outside_mass = expanded_logits.softmax(-1)[..., outside].sum(-1).max()
    expanded_choice = expanded_logits.argmax(-1)
    return {"positions": windows.numel(),
            "argmax_agreement": (expanded_choice == draft_choice).float().mean().item(),
            "outside_wins": 0 if maps is None else int((maps.t2d[expanded_choice] == maps.other_id).sum()),
            "max_outside_mass": outside_mass.item()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="models/tiny/draft")
    parser.add_argument("--target", default="models/tiny/target")
    parser.add_argument("--out", required=True)
    parser.add_argument("--check-windows", type=int, default=8, help="held-out windows of 256 tokens to check on")
    args = parser.parse_args(argv)
    out = export_assistant_draft(args.draft, args.target, args.out)
    windows = eval_windows(token_stream(source_files()[1]), args.check_windows)[:, :-1]
    print(json.dumps({"out": str(out), **check_expanded(args.draft, out, windows)}, indent=2))


if __name__ == "__main__":
    main()
