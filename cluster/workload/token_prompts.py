"""One fixed, seeded workload shared by every system in a side-by-side benchmark.

Every request is greedy with EOS ignored, so each one produces exactly `max_tokens`
tokens in every system: the token counts are identical by construction and the
throughput figures compare like with like.

- prompts: random token ids, lengths uniform in [prompt_min, prompt_max], drawn from
  [first_token_id, vocab_size) so that no special id (pad / bos / eos) appears
  (`avoid_token_ids` keeps out another model's special ids);
- output lengths: long-tailed, lognormal with mean ~`output_mean`, rounded and clipped
  to [1, output_cap] (the cap and the floor move the realised mean a little; it is
  printed with the workload);
- order: the list order is the arrival order (all requests arrive at t = 0).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from cluster.percentile import percentile
from cluster.workload.draws import lognormal_mu


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 128
    seed: int = 0
    vocab_size: int = 8192
    first_token_id: int = 3  # ids below this are special (pad 0, bos 1, eos 2)
    prompt_min: int = 16
    prompt_max: int = 256
    output_mean: float = 96.0
    output_sigma: float = 0.8  # lognormal shape: larger = longer tail
    output_cap: int = 384
    output_min: int = 1
    # Further ids to keep out of prompts (another model's special ids); redrawn if hit.
    avoid_token_ids: frozenset[int] = frozenset()


def make_workload(spec: WorkloadSpec) -> list[Request]:
    rng = random.Random(spec.seed)
    mu = lognormal_mu(spec.output_mean, spec.output_sigma)
    requests = []
    for i in range(spec.num_requests):
        prompt_len = rng.randint(spec.prompt_min, spec.prompt_max)
        prompt = [_draw_token(rng, spec) for _ in range(prompt_len)]
        out_len = int(round(rng.lognormvariate(mu, spec.output_sigma)))
        out_len = max(spec.output_min, min(spec.output_cap, out_len))
        requests.append(Request(f"req-{i:04d}", prompt, out_len))
    return requests


def _draw_token(rng: random.Random, spec: WorkloadSpec) -> int:
    while True:
        t = rng.randrange(spec.first_token_id, spec.vocab_size)
        if t not in spec.avoid_token_ids:
            return t


def describe(requests: list[Request]) -> str:
    """One line: the prompt and output lengths of a workload, and its useful tokens."""
    prompts = sorted(len(r.prompt_token_ids) for r in requests)
    outs = sorted(r.max_tokens for r in requests)
    p50, p90 = (int(percentile(outs, q, method="strict_rank")) for q in (50, 90))
    return (
        f"{len(requests)} requests; prompt tokens min/mean/max {prompts[0]}/"
        f"{sum(prompts) / len(prompts):.0f}/{prompts[-1]}; output tokens min/p50/mean/p90/max "
        f"{outs[0]}/{p50}/{sum(outs) / len(outs):.1f}/{p90}/{outs[-1]}; "
        f"useful output tokens {sum(outs)}"
    )
