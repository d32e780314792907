"""The drafter applies a row's logit_bias and penalties to its own proposal (gpu_worker/drafter/drafter_core.py),
on the tiny pair (a draft over 1024 ids with an "other" id): not needed for exactness, but a
draft that ignored them would propose tokens the verifier rejects; and a row that asks a tree gets
the draft's EAGLE-2 tree."""

import time

import pytest
import torch
import transformers

from gpu_worker.drafter.draft_trees import mask_other
from gpu_worker.drafter.drafter_core import draft_batch, load_drafter
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward
from gpu_worker.runtime.tree_draft import best_first_tree, preorder
from gpu_worker.sampling.coupling import gumbel_noise
from schemas.arrays import ROOT_PARENT
from schemas.config import DrafterConfig, load_config
from schemas.generation import RowSampling
from schemas.steps import DraftRequest, DraftRow
from tests.tiny_checkpoints import VD, VT, write_tiny_pair
from text.grammar import Grammars, llg_tokenizer
from text.tokenizer import load_tokenizer

PROMPT = [5, 17, 42, 8, 99, 23, 61, 3, 77, 12, 50, 31, 6]
OUTPUT = [17, 200, 17]  # a history of PROMPT + OUTPUT, prompt_len = len(PROMPT)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = write_tiny_pair(tmp_path_factory.mktemp("pair"))
    hf = transformers.LlamaForCausalLM.from_pretrained(draft).eval()
    drafter = load_drafter(load_config(DrafterConfig, env={}, draft_model=str(draft), instance_id="drafter-test",
                                       max_slots=4, max_seq_len=64, dtype="float32"))
    return hf, drafter


def drafts(drafter, num_draft=4, mode="greedy", **sampling):
    sampling.setdefault("coupling", "rejection")  # draft_mode's rows; a Gumbel-coupled one drafts by its noise
    row = DraftRow(request_id="r", row=0, step=0, cached_len=0, new_token_ids=PROMPT + OUTPUT, num_draft=num_draft,
                   draft_mode=mode, sampling=RowSampling(**sampling), prompt_len=len(PROMPT))
    request = DraftRequest(batch_id=1, scheduler_id="s", deadline=time.time() + 30, rows=[row], release=["r"])
    result = draft_batch(drafter, request).rows[0]
    assert not result.need_resync
    return result


def test_a_plus_100_bias_is_proposed_and_ids_the_draft_lacks_are_ignored(pair):
    _, drafter = pair
    # 3000 has no draft id of its own (it maps to "other"), VT is outside the target vocabulary
    # (the verifier fails that row): neither may fail the batch, costing every row its drafts
    result = drafts(drafter, logit_bias={500: 100.0, 3000: 100.0, VT: 100.0})
    assert result.draft_token_ids.tolist() == [500] * 4


def test_greedy_drafts_are_the_argmax_of_the_penalised_draft_logits(pair):
    hf, drafter = pair
    penalties = dict(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.4, logit_bias={17: 2.0})
    result = drafts(drafter, temperature=0, **penalties)
    history, output = list(PROMPT + OUTPUT), list(OUTPUT)  # the tiny pair maps ids < VD - 1 to themselves
    expected = []
    for _ in range(4):
        with torch.no_grad():
            logits = hf(torch.tensor([history])).logits[0, -1]
        logits[VD - 1] = float("-inf")  # "other"
        logits[17] += 2.0
        for token in set(history):
            logits[token] = logits[token] / 1.4 if logits[token] > 0 else logits[token] * 1.4
        for token in set(output):  # the output only: the prompt is not counted
            logits[token] -= output.count(token) * 1.0 + 1.5
        expected.append(int(logits.argmax()))
        history.append(expected[-1])
        output.append(expected[-1])
    assert result.draft_token_ids.tolist() == expected
    assert result.draft_token_ids.tolist() != drafts(drafter, temperature=0).draft_token_ids.tolist()


def test_a_sampled_proposal_is_the_penalised_distribution(pair):
    _, drafter = pair
    result = drafts(drafter, mode="sample", temperature=1.0, seed=3, logit_bias={500: 100.0, 17: -100.0})
    assert result.draft_token_ids.tolist() == [500] * 4
    ids, probs = result.proposal.ids, result.proposal.probs  # (4, S), the support of each draft
    assert (probs[ids == 500] > 0.999).all() and (probs[ids == 17] < 1e-30).all()


def test_a_gumbel_coupled_row_proposes_by_the_targets_noise_over_its_tempered_law_unfiltered(pair):
    """argmax(log q + G): q = softmax(logits / T) with no top-k / top-p (coupling.proposal_law), G
    the target's noise at the draft's stream position keyed by target ids (the tiny pair's draft
    ids below VD - 1 are the target's)."""
    hf, drafter = pair
    result = drafts(drafter, temperature=0.7, top_k=1, top_p=0.05, seed=5, coupling="gumbel")
    history, expected = list(PROMPT + OUTPUT), []
    for j in range(4):
        with torch.no_grad():
            logits = hf(torch.tensor([history])).logits[0, -1]
        logits[VD - 1] = float("-inf")  # "other"
        noise = gumbel_noise(torch.tensor([5]), torch.tensor([[len(PROMPT + OUTPUT) + j]]), drafter.d2t)[0, 0]
        expected.append(int(((logits / 0.7).softmax(-1).double().log() + noise).argmax()))
        history.append(expected[-1])
    assert result.draft_token_ids.tolist() == expected and result.proposal.kind == "point_mass"
    assert expected != drafts(drafter, temperature=0).draft_token_ids.tolist()  # top_k 1 would be the argmax


@pytest.mark.parametrize("mode,sampling", [("greedy", {"temperature": 0}), ("sample", {"temperature": 1.0, "seed": 5})])
def test_drafts_follow_the_rows_grammar(pair, mode, sampling):
    """A row with structured_outputs drafts under the grammar's mask, mapped to draft ids: every
    draft is a token the grammar allows after the ones before (docs/PROTOCOL.md#structured-outputs)."""
    _, drafter = pair
    spec = {"regex": "[0-9]{1,12}"}
    row = DraftRow(request_id="g", row=0, step=0, cached_len=0, new_token_ids=PROMPT, num_draft=4, draft_mode=mode,
                   sampling=RowSampling(structured_outputs=spec, **sampling), prompt_len=len(PROMPT))
    request = DraftRequest(batch_id=1, scheduler_id="s", deadline=time.time() + 30, rows=[row], release=[])
    result = draft_batch(drafter, request).rows[0]
    assert len(result.draft_token_ids) == 4
    tokenizer = load_tokenizer(drafter.tokenizer_dir)
    matcher = Grammars(llg_tokenizer(tokenizer, VT)).matcher(RowSampling(structured_outputs=spec).structured_outputs)
    assert matcher.validate_tokens(result.draft_token_ids.tolist()) == 4, tokenizer.decode(result.draft_token_ids)


@pytest.mark.parametrize("mode,sampling", [("greedy", {"temperature": 0}), ("sample", {"temperature": 1.0, "seed": 5})])
@pytest.mark.parametrize("regex,num_drafts", [("[0-9]-abcdefgh[0-9]", 1), ("abcdefgh[0-9]+", 0)])
def test_a_row_stops_drafting_where_its_grammar_forces_the_next_token(pair, mode, sampling, regex, num_drafts):
    """The forced tokens are the verifier's to append: the drafter drafts the free positions
    before them and no further."""
    _, drafter = pair
    row = DraftRow(request_id="forced", row=0, step=0, cached_len=0, new_token_ids=PROMPT, num_draft=4,
                   draft_mode=mode, sampling=RowSampling(structured_outputs={"regex": regex}, **sampling),
                   prompt_len=len(PROMPT))
    request = DraftRequest(batch_id=1, scheduler_id="s", deadline=time.time() + 30, rows=[row], release=["forced"])
    result = draft_batch(drafter, request).rows[0]
    assert len(result.draft_token_ids) == num_drafts
    if num_drafts:
        assert load_tokenizer(drafter.tokenizer_dir).decode(result.draft_token_ids).isdigit()


def test_a_row_that_asks_a_tree_gets_the_drafts_eagle2_tree(pair):
    """The tree drafted by one tree_forward a level is the tree of feeding every path alone
    (gpu_worker/runtime/tree_draft.py's search over `forward`'s logits), and the slot keeps the history."""
    _, drafter = pair
    history = PROMPT + OUTPUT                        # ids < VD - 1: draft ids are the target ids
    row = DraftRow(request_id="t", row=0, step=0, cached_len=0, new_token_ids=history, num_draft=4, max_nodes=12,
                   sampling=RowSampling(temperature=0), prompt_len=len(PROMPT))
    result = draft_batch(drafter, DraftRequest(batch_id=2, scheduler_id="s", deadline=time.time() + 30,
                                               rows=[row])).rows[0]
    model = drafter.model
    cache = KVCache(model.config, 1, 64)

    def logits_after(path: list[int]) -> torch.Tensor:
        slot = cache.allocate()
        tokens = history + path
        logits = forward(model, cache, torch.tensor([slot]), torch.tensor([tokens]), torch.tensor([len(tokens)]))
        cache.free(slot)
        return mask_other(drafter, logits[:, -1].float().clone())[0]

    def path_of(n, nodes):
        return ([] if nodes[n].parent == ROOT_PARENT else path_of(nodes[n].parent, nodes)) + [nodes[n].draft_id]

    nodes, kept = best_first_tree(logits_after([]), lambda chosen, nodes: torch.stack(
        [logits_after(path_of(n, nodes)) for n in chosen]), 4, 12, 3)
    assert (result.draft_token_ids.tolist(), result.parents.tolist()) == preorder(nodes, kept, drafter.d2t)
    assert len(kept) == 12 and result.proposal.kind == "point_mass"
    state = drafter.requests[("s", "t")]
    assert int(drafter.cache.lengths[state.slot]) == len(state.token_ids) == len(history)
