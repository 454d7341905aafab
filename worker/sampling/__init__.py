"""Sampling: one step's logits to next tokens for the whole batch at once.

    sampler.py          Sampler: penalties, temperature, top-k/p/min-p, seeds, logprobs
    sampled_batch.py    a step's samples between device and host (one sync per step)
    prompt_logprobs.py  prompt logprobs
"""
