"""Test-only fault injection for tests/system/test_selfcheck.py: a known-bad rejection rule in the
verifier. Python imports `sitecustomize` at start-up from sys.path, so it runs only in a process
whose PYTHONPATH holds this directory, which the test gives the verifier alone, together with
SPECBUS_TEST_REJECTION_RULE=same_token_bypass. Nothing shipped reads either.

The bad rule (the same-token bypass): a draft token is also accepted whenever the target's own
sample at its position equals it. Done by zeroing the acceptance uniform there, so u * p < q holds
(q(d) > 0, since the target drew d). The rejection sampler's module attribute is replaced before
gpu_worker.sampling.acceptance imports it by name.
"""

import os

if os.environ.get("SPECBUS_TEST_REJECTION_RULE") == "same_token_bypass":
    import torch

    import gpu_worker.sampling.rejection

    correct_rejection_sample = gpu_worker.sampling.rejection.rejection_sample

    def same_token_bypass(draft_token_ids, num_draft, draft_probs, target_probs, target_token_ids, greedy,
                          generator=None, *, uniforms=None, **options):
        B, K = draft_token_ids.shape
        if uniforms is None:
            uniforms = torch.rand(B, K, generator=generator, dtype=torch.float64, device=draft_token_ids.device)
        same = draft_token_ids == target_token_ids[:, :K]
        return correct_rejection_sample(draft_token_ids, num_draft, draft_probs, target_probs, target_token_ids,
                                        greedy, generator, uniforms=torch.where(same, 0.0, uniforms), **options)

    gpu_worker.sampling.rejection.rejection_sample = same_token_bypass
