"""The seeded workload of `python -m benchmarks.disagg` (its metrics:
benchmarks/disagg_metrics.py).

One round of the workload, the same for both sides (mixed pool, disaggregated pools):

    t=0        decode-heavy streams start, staggered: `num_decode_streams` slots, each one
               sending a short prompt with a long output, then the next, back to back
               (a closed loop: a steady population of decoding sequences);
    t=ramp_s   long prompts (long prompt, short output) start arriving, one every
               `long_period_s` (+- `long_jitter` of it, seeded);
    end        once every long prompt is answered the slots send nothing new; the streams
               in flight finish.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from cluster.workload.draws import sample_lengths
from cluster.workload.text_prompts import BenchRequest, PromptCalibration, generate_workload, random_text


@dataclass(frozen=True)
class DisaggSpec:
    """Sizes of the run; the CLI exposes every field as a flag (--num-decode-streams ...)."""

    seed: int = 0
    num_rounds: int = 2  # per side; each round the order of the sides rotates by one
    num_decode_streams: int = 12
    decode_prompt_len: int = 32
    decode_output_len: int = 96
    num_long_prompts: int = 6  # per round
    long_prompt_len: int = 1536
    long_output_len: int = 8
    long_period_s: float = 2.0
    long_jitter: float = 0.25  # fraction of the period
    ramp_s: float = 2.0  # decode population first, then long prompts
    stream_stagger_s: float = 0.1  # between the decode slots' first requests
    range_ratio: float = 0.25  # decode-heavy lengths uniform within +- this of the mean
    # The disaggregated pools' token budget per step (their prefill pool wants it large).
    max_num_batched_tokens: int = 2048
    # The mixed pool runs once per chunked-prefill token budget here, each a side of its own:
    # a small budget is the standard answer to the prefill/decode interference that
    # disaggregation targets, so the mixed pool is measured at the budgets that tune it.
    mixed_budgets: tuple[int, ...] = (256, 512, 2048)
    max_num_seqs: int = 64
    max_model_len: int = 2048


QUICK = {"num_rounds": 1, "num_decode_streams": 8, "num_long_prompts": 3, "decode_output_len": 64, "long_prompt_len": 1024}


def round_seed(spec: DisaggSpec, round_index: int) -> int:
    """Each round draws fresh prompts (no prefix-cache hit carries over from the previous
    round on the same app); both sides get the same prompts in round r."""
    return spec.seed * 1000 + round_index


def decode_stream_requests(
    spec: DisaggSpec, seed: int, slot: int, calibration: PromptCalibration = PromptCalibration()
) -> Iterator[BenchRequest]:
    """The endless, seeded sequence of decode-heavy requests one slot sends (the slot stops
    drawing when the round ends). Indices are slot * 1_000_000 + k, unique in a round."""
    rng = random.Random(f"kvserve-disagg-decode:{seed}:{slot}")
    k = 0
    while True:
        prompt_len = sample_lengths(rng, 1, spec.decode_prompt_len, spec.range_ratio)[0]
        output_len = sample_lengths(rng, 1, spec.decode_output_len, spec.range_ratio, minimum=2)[0]
        text = random_text(rng, calibration.words_for(prompt_len - calibration.overhead_tokens))
        yield BenchRequest(slot * 1_000_000 + k, text, prompt_len, output_len)
        k += 1


def long_requests(spec: DisaggSpec, seed: int, calibration: PromptCalibration = PromptCalibration()) -> list[BenchRequest]:
    """The round's long prompts (exact lengths asked: no range)."""
    return generate_workload(
        "random",
        num_prompts=spec.num_long_prompts,
        seed=seed,
        input_len=spec.long_prompt_len,
        output_len=spec.long_output_len,
        calibration=calibration,
    )


def long_arrivals(spec: DisaggSpec, seed: int) -> list[float]:
    """Seconds from the round's start at which each long prompt is sent: periodic after
    the ramp, each moved by a seeded jitter; increasing and never before the ramp."""
    if not 0.0 <= spec.long_jitter < 0.5:
        raise ValueError("long_jitter must be in [0, 0.5) so that arrivals stay in order")
    rng = random.Random(f"kvserve-disagg-long:{seed}")
    jitter = spec.long_jitter * spec.long_period_s
    return [
        spec.ramp_s + i * spec.long_period_s + (rng.uniform(0.0, jitter) if i == 0 else rng.uniform(-jitter, jitter))
        for i in range(spec.num_long_prompts)
    ]
