"""Sampler: greedy, random sampling filters, seeds, penalties, min_tokens, logprobs."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from worker.sampling.sampler import Sampler
from worker.api import SamplingParams
from worker.sequence import Sequence

CPU = torch.device("cpu")


def make_seq(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
    request_id: str = "r",
) -> Sequence:
    prompt = prompt if prompt is not None else [1, 2, 3]
    seq = Sequence(request_id, prompt, params, eos_token_ids=eos)
    for token_id in output or []:
        seq.append_token(token_id)
    return seq


def random_logits(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=g) * 3.0


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax() -> None:
    logits = random_logits(8, 50, seed=0)
    seqs = [make_seq(SamplingParams(temperature=0.0)) for _ in range(8)]
    out = Sampler(50, CPU)(logits, seqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(6, 40, seed=1)
    seqs = [make_seq(SamplingParams(temperature=1.0, top_k=1)) for _ in range(6)]
    out = Sampler(40, CPU)(logits, seqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = random_logits(6, 40, seed=2)
    torch.manual_seed(0)
    for _ in range(20):
        seqs = [make_seq(SamplingParams(temperature=1.5, top_p=1e-6)) for _ in range(6)]
        out = Sampler(40, CPU)(logits, seqs)
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_padded_vocab_columns_are_never_sampled() -> None:
    # The lm_head may be wider than the vocabulary; the extra columns are not tokens.
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 100.0
    seqs = [make_seq(SamplingParams(temperature=0.0)), make_seq(SamplingParams(seed=1))]
    out = Sampler(10, CPU)(logits, seqs)
    assert all(t < 10 for t in out.token_ids)


def test_input_logits_are_not_modified() -> None:
    logits = random_logits(4, 30, seed=3)
    before = logits.clone()
    seqs = [
        make_seq(SamplingParams(temperature=0.0, repetition_penalty=1.3), output=[5]),
        make_seq(SamplingParams(temperature=0.9, top_k=5, min_p=0.1), eos=frozenset({0})),
        make_seq(SamplingParams(temperature=0.7, top_p=0.8, min_tokens=3), eos=frozenset({0})),
        make_seq(SamplingParams(temperature=1.0, logprobs=2)),
    ]
    Sampler(30, CPU)(logits, seqs)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- seeds


def _run_seeded(
    target: SamplingParams,
    step_logits: list[torch.Tensor],
    batch_size: int,
    position: int,
    others_seed: int,
) -> list[int]:
    """Sample `len(step_logits)` tokens for one seeded request placed at `position` in a
    batch of `batch_size`, the other rows being fresh random (unseeded, seeded with other
    seeds, or greedy) requests with unrelated logits."""
    sampler = Sampler(step_logits[0].shape[0], CPU)
    target_seq = make_seq(target, request_id="target")
    other_params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, seed=999),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=7),
        # A top_p row sends the whole random sub-batch down the sort path.
        SamplingParams(temperature=0.9, top_p=0.5),
    ]
    others = [
        make_seq(other_params[j % len(other_params)], request_id=f"o{j}")
        for j in range(batch_size - 1)
    ]
    torch.manual_seed(others_seed)  # the batch-level noise differs between runs
    tokens: list[int] = []
    for step, row_logits in enumerate(step_logits):
        seqs = list(others)
        seqs.insert(position, target_seq)
        logits = random_logits(batch_size, row_logits.shape[0], seed=others_seed * 1000 + step)
        logits[position] = row_logits
        out = sampler(logits, seqs)
        token = out.token_ids[position]
        tokens.append(token)
        for seq, t in zip(seqs, out.token_ids):
            seq.append_token(t)
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1234),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=7),
        SamplingParams(temperature=1.3, top_k=5, seed=2**62),
    ],
)
def test_seeded_request_is_reproducible_regardless_of_batch(params: SamplingParams) -> None:
    vocab = 64
    # Flat-ish logits so that the noise, not the logits, decides the token.
    step_logits = [random_logits(1, vocab, seed=100 + s)[0] * 0.3 for s in range(12)]
    alone = _run_seeded(params, step_logits, batch_size=1, position=0, others_seed=1)
    batched_a = _run_seeded(params, step_logits, batch_size=5, position=3, others_seed=2)
    batched_b = _run_seeded(params, step_logits, batch_size=8, position=0, others_seed=3)
    batched_c = _run_seeded(params, step_logits, batch_size=3, position=2, others_seed=4)
    assert alone == batched_a == batched_b == batched_c
    # And the seed matters: a different seed gives a different stream.
    other_seed = SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=(params.seed or 0) + 1,
    )
    assert _run_seeded(other_seed, step_logits, 1, 0, 1) != alone


def test_seed_generator_is_created_lazily_and_kept() -> None:
    seq = make_seq(SamplingParams(seed=5))
    assert seq.sampler_state is None
    Sampler(10, CPU)(torch.zeros(1, 10), [seq])
    generator = seq.sampler_state
    assert isinstance(generator, torch.Generator)
    Sampler(10, CPU)(torch.zeros(1, 10), [seq])
    assert seq.sampler_state is generator


# ---------------------------------------------------------------- filters & distribution


def _histogram(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_temperature_sampling_matches_softmax() -> None:
    vocab = 6
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.7
    expected = torch.softmax(row.double() / temperature, dim=-1)

    # Many unseeded rows in one batch (batch-level noise).
    num_rows = 20000
    torch.manual_seed(0)
    seqs = [make_seq(SamplingParams(temperature=temperature)) for _ in range(num_rows)]
    out = Sampler(vocab, CPU)(row.expand(num_rows, vocab).contiguous(), seqs)
    assert torch.allclose(_histogram(out.token_ids, vocab), expected, atol=0.015)

    # One seeded request over many steps (its own generator).
    seq = make_seq(SamplingParams(temperature=temperature, seed=42))
    sampler = Sampler(vocab, CPU)
    tokens = [sampler(row.unsqueeze(0), [seq]).token_ids[0] for _ in range(4000)]
    assert torch.allclose(_histogram(tokens, vocab), expected, atol=0.03)


def test_top_k_top_p_distribution_is_renormalised() -> None:
    vocab = 8
    row = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    probs = torch.softmax(row.double(), dim=-1)
    num_rows = 20000
    torch.manual_seed(1)

    # top_k=3: only the 3 best, renormalised.
    seqs = [make_seq(SamplingParams(top_k=3)) for _ in range(num_rows)]
    hist = _histogram(Sampler(vocab, CPU)(row.expand(num_rows, vocab), seqs).token_ids, vocab)
    expected = torch.zeros(vocab, dtype=torch.double)
    expected[:3] = probs[:3] / probs[:3].sum()
    assert torch.allclose(hist, expected, atol=0.015)

    # top_p: the smallest prefix whose mass reaches top_p.
    top_p = float(probs[:2].sum()) + 0.01  # needs the third token too
    seqs = [make_seq(SamplingParams(top_p=top_p)) for _ in range(num_rows)]
    hist = _histogram(Sampler(vocab, CPU)(row.expand(num_rows, vocab), seqs).token_ids, vocab)
    assert torch.allclose(hist, expected, atol=0.015)

    # Mixed batch: rows with and without top_k in the same call.
    seqs = [
        make_seq(SamplingParams(top_k=2 if i % 2 else 0)) for i in range(num_rows)
    ]
    tokens = Sampler(vocab, CPU)(row.expand(num_rows, vocab), seqs).token_ids
    with_k = _histogram(tokens[1::2], vocab)
    without_k = _histogram(tokens[0::2], vocab)
    expected_k2 = torch.zeros(vocab, dtype=torch.double)
    expected_k2[:2] = probs[:2] / probs[:2].sum()
    assert torch.allclose(with_k, expected_k2, atol=0.02)
    assert torch.allclose(without_k, probs, atol=0.02)


def test_min_p_keeps_exactly_the_tokens_above_the_cut() -> None:
    vocab = 8
    row = torch.log(torch.tensor([0.30, 0.20, 0.16, 0.14, 0.10, 0.06, 0.03, 0.01]))
    # min_p=0.5: keep p >= 0.15 -> tokens 0, 1, 2.
    num_rows = 5000
    torch.manual_seed(2)
    seqs = [make_seq(SamplingParams(min_p=0.5)) for _ in range(num_rows)]
    tokens = Sampler(vocab, CPU)(row.expand(num_rows, vocab), seqs).token_ids
    assert set(tokens) == {0, 1, 2}
    hist = _histogram(tokens, vocab)
    expected = torch.tensor([0.30, 0.20, 0.16], dtype=torch.double) / 0.66
    assert torch.allclose(hist[:3], expected, atol=0.03)


# ---------------------------------------------------------------- penalties


def test_penalty_values_on_hand_made_logits() -> None:
    vocab = 6
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 2.2, -2.0, 1.2],
            [2.0, -1.0, 0.5, 2.2, -2.0, 1.2],
            [2.0, -1.0, 0.5, 2.2, -2.0, 1.2],
        ]
    )
    seqs = [
        # Repetition only: prompt {0, 1}, output {3} -> all three penalised, HF style.
        make_seq(
            SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0, 1], output=[3]
        ),
        # Presence + frequency: output [2, 2, 4] (prompt tokens do not count).
        make_seq(
            SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
            prompt=[0, 5],
            output=[2, 2, 4],
        ),
        # No penalties at all.
        make_seq(SamplingParams(temperature=0.0), prompt=[0], output=[1]),
    ]
    sampler = Sampler(vocab, CPU)
    rows = [i for i, s in enumerate(seqs) if s.params.needs_penalties]
    out = sampler._apply_penalties(logits, seqs, rows)
    expected = torch.tensor(
        [
            # positive logits / 2, negative * 2, unseen (2, 4, 5) untouched
            [1.0, -2.0, 0.5, 1.1, -2.0, 1.2],
            # token 2: 0.5 - 2*0.25 - 0.5 = -0.5; token 4: -2 - 0.25 - 0.5 = -2.75
            [2.0, -1.0, -0.5, 2.2, -2.75, 1.2],
            [2.0, -1.0, 0.5, 2.2, -2.0, 1.2],
        ]
    )
    assert torch.equal(out, expected)
    # The end-to-end effect: the repetition penalty moves row 0's greedy pick off 3.
    assert logits.argmax(dim=-1).tolist() == [3, 3, 3]
    assert sampler(logits, seqs).token_ids == [5, 3, 3]


def test_repetition_penalty_below_one_boosts_seen_tokens() -> None:
    logits = torch.tensor([[1.0, 0.9, -0.5, -0.4]])
    seq = make_seq(SamplingParams(temperature=0.0, repetition_penalty=0.5), prompt=[1, 2])
    out = Sampler(4, CPU)._apply_penalties(logits, [seq], [0])
    assert torch.equal(out, torch.tensor([[1.0, 1.8, -0.25, -0.4]]))


def test_penalties_with_empty_output() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    seq = make_seq(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), prompt=[2])
    out = Sampler(3, CPU)._apply_penalties(logits, [seq], [0])
    assert torch.equal(out, logits)


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    vocab = 10
    eos = frozenset({9})
    logits = torch.zeros(1, vocab)
    logits[0, 9] = 50.0  # EOS is overwhelming
    logits[0, 8] = 40.0  # then a stop token id
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(8,), max_tokens=5)
    sampler = Sampler(vocab, CPU)

    seq = make_seq(params, eos=eos)
    first = sampler(logits, [seq]).token_ids[0]
    assert first not in (8, 9)
    seq.append_token(first)
    assert sampler(logits, [seq]).token_ids[0] not in (8, 9)
    seq.append_token(first)
    assert sampler(logits, [seq]).token_ids[0] == 9  # min_tokens reached

    # ignore_eos: EOS is not masked by min_tokens, stop tokens still are.
    seq = make_seq(
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(8,), ignore_eos=True), eos=eos
    )
    assert sampler(logits, [seq]).token_ids[0] == 9

    # Random rows obey the mask too.
    torch.manual_seed(0)
    seqs = [make_seq(SamplingParams(temperature=1.0, min_tokens=1), eos=eos) for _ in range(200)]
    assert 9 not in sampler(logits.expand(200, vocab), seqs).token_ids


# ---------------------------------------------------------------- logprobs


def test_logprobs_match_log_softmax_of_raw_logits() -> None:
    vocab = 30
    logits = random_logits(4, vocab, seed=9)
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.8), output=[1]),
        make_seq(SamplingParams(temperature=0.6, top_k=4, seed=3, logprobs=0)),
        make_seq(SamplingParams(temperature=0.0)),  # did not ask
        make_seq(SamplingParams(temperature=1.7, logprobs=20)),
    ]
    out = Sampler(vocab, CPU)(logits, seqs)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(reference[i, token].item(), abs=1e-5)
        n = seqs[i].params.logprobs
        assert len(lp.top) == n
        top_values, top_ids = reference[i].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-5)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)


# ---------------------------------------------------------------- sync discipline (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_device_syncs_per_call() -> None:
    device = torch.device("cuda")
    vocab = 1000
    sampler = Sampler(vocab, device)
    logits = torch.randn(6, vocab, device=device)
    common = [
        make_seq(SamplingParams(temperature=0.0)),
        make_seq(SamplingParams(temperature=0.8, top_p=0.9, seed=1)),
        make_seq(SamplingParams(temperature=1.0, top_k=20, min_p=0.05)),
        make_seq(SamplingParams(repetition_penalty=1.2, presence_penalty=0.3), output=[4, 4]),
        make_seq(SamplingParams(min_tokens=3), eos=frozenset({2})),
        make_seq(SamplingParams(temperature=0.5)),
    ]

    def count_syncs(seqs: list[Sequence]) -> int:
        sampler(logits, seqs)  # warm up (lazy generators, allocator)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sampler(logits, seqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    assert count_syncs(common) == 1
    with_logprobs = list(common)
    with_logprobs[5] = make_seq(SamplingParams(temperature=0.5, logprobs=3))
    assert count_syncs(with_logprobs) == 2
    assert not math.isnan(logits.sum().item())


def test_logprobs_when_every_row_asks() -> None:
    vocab = 25
    logits = random_logits(3, vocab, seed=11)
    seqs = [make_seq(SamplingParams(temperature=0.9, seed=i, logprobs=i + 1)) for i in range(3)]
    out = Sampler(vocab, CPU)(logits, seqs)
    reference = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(reference[i, lp.token_id].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == reference[i].topk(i + 1).indices.tolist()


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_forces_and_bans_tokens_per_row() -> None:
    logits = random_logits(3, 30, seed=7)
    best = logits.argmax(dim=-1).tolist()
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logit_bias=((5, 100.0),))),  # forced
        make_seq(SamplingParams(temperature=0.0, logit_bias=((best[1], -100.0),))),  # banned
        make_seq(SamplingParams(temperature=0.0)),  # untouched
    ]
    out = Sampler(30, CPU)(logits, seqs)
    assert out.token_ids[0] == 5
    second = logits[1].clone()
    second[best[1]] -= 100.0
    assert out.token_ids[1] == int(second.argmax())
    assert out.token_ids[2] == best[2]


def test_logit_bias_forces_a_token_when_sampling_and_keeps_raw_logprobs() -> None:
    logits = random_logits(1, 30, seed=8)
    before = logits.clone()
    seq = make_seq(SamplingParams(temperature=1.0, logit_bias=((11, 100.0),), logprobs=0))
    out = Sampler(30, CPU)(logits, [seq])
    assert out.token_ids == [11]
    assert torch.equal(logits, before)  # the caller's logits are not modified
    # logprobs come from the raw logits, as vLLM's default ("raw_logprobs")
    assert math.isclose(out.logprobs[0].logprob, float(before.log_softmax(-1)[0, 11]), rel_tol=1e-5)


def test_logit_bias_validation() -> None:
    from worker.api import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="\\[-100, 100\\]"):
        SamplingParams(logit_bias=((1, 101.0),))
    with pytest.raises(SamplingParamsError, match=">= 0"):
        SamplingParams(logit_bias=((-1, 1.0),))
