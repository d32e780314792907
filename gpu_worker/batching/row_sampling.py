"""A row's RowSampling as the sampler's tensors, for the verifier (the target's distributions)
and the drafter (its proposal), which apply the same steps (gpu_worker/sampling/sampler.py):
SamplingTensors of one row (`row_params`; SamplingTensors.cat joins a batch's), and a row's
logit_bias and penalties over its history (`row_penalties`).
"""

import functools

import numpy as np
import torch

from gpu_worker.sampling.sampler import Penalties, SamplingTensors
from schemas.generation import RowSampling

@functools.lru_cache(maxsize=1024)
def params_of(temperature: float, top_k: int, top_p: float, min_p: float, device) -> SamplingTensors:
    """One row's SamplingTensors (1,), built once per distinct setting: building and checking
    the four tensors per row and step would cost more than a small batch's sampling (see
    ops/bench/RESULTS.md, Figures behind gpu_worker's choices). Nothing mutates them."""
    return SamplingTensors.build([temperature], [top_k], [top_p], [min_p], device=device)


def row_params(sampling: RowSampling, device=None, *, greedy: bool = False,
               top_k_cap: int | None = None) -> SamplingTensors:
    """The row's SamplingTensors (1,). greedy: drawn as temperature 0 whatever the row's
    temperature (a draft in draft_mode "greedy"); top_k_cap: top_k at most this, 0 (off)
    becoming the cap. SamplingInputError naming the field for a value the kernels refuse."""
    top_k = sampling.top_k if top_k_cap is None else min(sampling.top_k or top_k_cap, top_k_cap)
    return params_of(0.0 if greedy else sampling.temperature, top_k, sampling.top_p, sampling.min_p, device)


def logit_bias_tensors(sampling: RowSampling) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The row's logit_bias as (ids (n,) int64, values (n,) float32); (None, None) without one."""
    bias = sampling.logit_bias
    if bias is None:
        return None, None
    return torch.from_numpy(bias.token_ids.astype(np.int64)), torch.from_numpy(bias.bias)


def row_penalties(sampling: RowSampling, vocab_size: int, history: torch.Tensor, prompt_len: int,
                  bias_ids: torch.Tensor | None = None, bias_values: torch.Tensor | None = None,
                  device=None) -> Penalties:
    """The row's logit_bias (bias_ids (n,) < vocab_size, bias_values (n,)) and penalties over
    history (L,) int64 ids < vocab_size: the prompt (its first prompt_len ids), then the output.
    SamplingInputError naming the field for a value the kernels refuse."""
    return Penalties.build(vocab_size, history, prompt_len, bias_ids=bias_ids, bias_values=bias_values,
                           repetition=sampling.repetition_penalty, frequency=sampling.frequency_penalty,
                           presence=sampling.presence_penalty, device=device)
