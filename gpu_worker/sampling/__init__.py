"""Sampling math: logit processing and counter-based uniforms, rejection sampling, logprobs, coupling."""
