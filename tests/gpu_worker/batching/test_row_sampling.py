"""A row's sampling tensors and penalties (gpu_worker/batching/row_sampling.py), which the verifier
and the drafter both build from a RowSampling."""

import pytest
import torch

from gpu_worker.batching.row_sampling import logit_bias_tensors, row_params, row_penalties
from gpu_worker.sampling.sampler import Penalties, SamplingInputError, SamplingTensors
from schemas.generation import RowSampling


def test_a_batch_of_rows_is_the_tensors_built_from_the_lists():
    rows = [RowSampling(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=1), RowSampling(temperature=0)]
    joined = SamplingTensors.cat([row_params(s) for s in rows])
    built = SamplingTensors.build([0.7, 0.0], [5, 0], [0.9, 1.0], [0.1, 0.0])
    for name in ("temperature", "top_k", "top_p", "min_p"):
        assert torch.equal(getattr(joined, name), getattr(built, name))


def test_a_greedy_draft_is_drawn_at_temperature_0_and_top_k_is_capped():
    sampled = RowSampling(temperature=0.8, seed=1)
    params = row_params(sampled, greedy=True, top_k_cap=64)
    assert params.temperature.tolist() == [0.0] and params.top_k.tolist() == [64]  # 0 (off) becomes the cap
    assert row_params(RowSampling(temperature=0.8, top_k=100, seed=1), top_k_cap=64).top_k.tolist() == [64]
    assert row_params(RowSampling(temperature=0.8, top_k=10, seed=1), top_k_cap=64).top_k.tolist() == [10]


def test_penalties_are_the_rows_bias_and_penalties_over_its_history():
    sampling = RowSampling(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2,
                           logit_bias={3: 2.0})
    ids, values = logit_bias_tensors(sampling)
    history = torch.tensor([1, 2, 2, 4], dtype=torch.int64)
    penalties = row_penalties(sampling, 8, history, 2, ids, values)
    expected = Penalties.build(8, history, 2, bias_ids=torch.tensor([3]), bias_values=torch.tensor([2.0]),
                               repetition=1.2, frequency=0.25, presence=0.5)
    for name in Penalties.__dataclass_fields__:
        assert torch.equal(getattr(penalties, name), getattr(expected, name))
    assert logit_bias_tensors(RowSampling()) == (None, None)


def test_a_value_the_kernels_refuse_names_its_field():
    sampling = RowSampling(temperature=0, logit_bias={3: 2.0})
    ids, values = logit_bias_tensors(sampling)
    with pytest.raises(SamplingInputError, match="out of range") as raised:
        row_penalties(sampling, 3, torch.tensor([0, 1]), 1, ids, values)
    assert raised.value.field == "logit_bias"
