"""Seeded synthetic workloads for the simulator (nothing is downloaded).

Every workload is a list of `SimRequest`, sorted by arrival time, built from one
`numpy.random.Generator(seed)`: the same (kind, num_requests, rate, seed, kw) gives the
same list, token for token. Token ids are what the real KV manager hashes, so where a
workload shares a prefix the requests share the SAME token ids for it and get real
prefix-cache hits (kv.block_hash chains them block by block); elsewhere the ids are
independent random draws, which never collide on a full block in practice.

Kinds:
  sharegpt  chat, no deliberate prefix reuse, lognormal input/output lengths
  b2b       G customer groups; each request = its group's long system prefix + a question
  agentic   multi-turn sessions; each turn re-sends the whole history plus new tokens
  code      long context (tens of thousands of prompt tokens: a repository prefix plus
            files), short outputs
  bursty    sharegpt lengths, gamma-distributed inter-arrival gaps (bursts)
  trace     replay of a Mooncake-style JSONL trace (`path=`)
  lora      sharegpt lengths, each request for one of 64 LoRA adapters, Zipf popularity
Arrivals are Poisson at `rate_rps` except for bursty (gamma) and trace (the file's times).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cluster.workload.draws import around, gamma_arrivals, log_uniform, lognormal_lengths, poisson_arrivals

# Token ids are drawn from [1, DEFAULT_VOCAB); every shape we ship has a larger vocabulary.
DEFAULT_VOCAB = 32000
# Mooncake traces name prompt blocks of 512 tokens by hash id (FAST'25 artifact README).
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    session_id: str | None = None
    # Served like any other request, measured by no figure (cluster/sim/metrics.py): what
    # brings the replicas' caches to the state a long-running cluster would be in.
    warmup: bool = False
    lora_name: str | None = None  # the LoRA adapter that serves it (None: the base model)
    # Closed loop (cluster/sim/follow_ups.py): it arrives pause_s after request `after`
    # finishes; arrival_s is then only the open-loop estimate the list is sorted by.
    after: str | None = None
    pause_s: float = 0.0


def make_workload(kind: str, num_requests: int, rate_rps: float, seed: int, **kw: object) -> list[SimRequest]:
    """`num_requests` requests of `kind` arriving at `rate_rps` on average (see the module
    docstring). Keyword arguments tune the kind (e.g. num_groups=, prefix_len= for b2b)."""
    builder = WORKLOADS.get(kind)
    if builder is None:
        raise ValueError(f"unknown workload {kind!r}; choose one of {sorted(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if kind != "trace" and rate_rps <= 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    rng = np.random.default_rng(seed)
    requests = builder(rng, num_requests, rate_rps, **kw)
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    return requests


# -- building blocks ----------------------------------------------------------------------
def _tokens(rng: np.random.Generator, n: int, vocab: int = DEFAULT_VOCAB) -> tuple[int, ...]:
    return tuple(rng.integers(1, vocab, size=int(n)).tolist())


def _shared_prefix_requests(rng: np.random.Generator, kind: str, group_name: str, n: int, rate_rps: float,
                            num_groups: int, prefix_len: int,
                            lengths: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]],
                            warmup_s: float = 0.0, warmup_max_tokens: int | None = None) -> list[SimRequest]:
    """n requests arriving as a Poisson process, each one of `num_groups` shared prefixes
    (`prefix_len` tokens, picked uniformly; the session id names it) followed by a fresh
    suffix. `lengths(rng, n)` draws the (suffix, output) lengths. The order of the draws
    (prefixes, arrivals, groups, lengths, suffixes, then any warm-up) is part of what a
    seed means: changing it changes every seeded b2b / code workload.

    warmup_s > 0: first, one warm-up request per group (its prefix + a fresh suffix, an
    answer drawn like the others') at uniform random times in [0, warmup_s); the measured
    requests then arrive from warmup_s on. A long-running cluster holds every group's
    prefix somewhere, and is decoding answers when a request arrives; without the warm-up a
    short run would measure mostly first-time misses on idle replicas. `warmup_max_tokens`
    caps the warm-up answers (the draws stay as they are): what a warm-up is for is the
    caches and the routers' ownership, and its answers' decode, which costs a simulation as
    much as the measured requests', has mostly ended before the window opens anyway."""
    prefixes = [_tokens(rng, prefix_len) for _ in range(num_groups)]
    arrivals = poisson_arrivals(rng, n, rate_rps)
    groups = rng.integers(0, num_groups, size=n)
    suffixes, outputs = lengths(rng, n)
    out = [SimRequest(f"{kind}-{i}", warmup_s + float(arrivals[i]), prefixes[groups[i]] + _tokens(rng, suffixes[i]),
                      int(outputs[i]), session_id=f"{group_name}-{groups[i]}") for i in range(n)]
    if warmup_s > 0:
        times = rng.uniform(0.0, warmup_s, size=num_groups)
        warm_suffixes, warm_outputs = lengths(rng, num_groups)
        if warmup_max_tokens is not None:
            warm_outputs = np.minimum(warm_outputs, warmup_max_tokens)
        out += [SimRequest(f"{kind}-warmup-{g}", float(times[g]), prefixes[g] + _tokens(rng, warm_suffixes[g]),
                           int(warm_outputs[g]), session_id=f"{group_name}-{g}", warmup=True)
                for g in range(num_groups)]
    return out


# -- the kinds ------------------------------------------------------------------------------
# ShareGPT lengths. Published figures differ with the sample and its filtering: the vLLM
# paper (Kwon et al., SOSP 2023, Sec. 6.1, Fig. 11) reports means of 161 input / 338 output
# tokens for its ShareGPT sample; the samples commonly used by serving benchmarks after
# vLLM's benchmark filter average a few hundred input tokens and ~200 output tokens. We
# follow this project's brief (mean input ~300, output ~200) with a lognormal long tail;
# every figure is a keyword argument (input_mean, output_mean, sigma, max_len).
SHAREGPT_INPUT_MEAN = 300.0
SHAREGPT_OUTPUT_MEAN = 200.0
SHAREGPT_SIGMA = 1.0  # lognormal shape: median ~ 0.6 x mean, p99 ~ 6 x mean
SHAREGPT_MAX_LEN = 4096


def _sharegpt_requests(rng: np.random.Generator, kind: str, arrivals: np.ndarray, input_mean: float,
                       output_mean: float, sigma: float, max_len: int) -> list[SimRequest]:
    """One request per arrival, ShareGPT-like lognormal lengths, no shared prefix."""
    n = len(arrivals)
    inputs = lognormal_lengths(rng, n, input_mean, sigma, 4, max_len)
    outputs = lognormal_lengths(rng, n, output_mean, sigma, 1, max_len)
    return [SimRequest(f"{kind}-{i}", float(arrivals[i]), _tokens(rng, inputs[i]), int(outputs[i]))
            for i in range(n)]


def _sharegpt(rng: np.random.Generator, n: int, rate_rps: float, input_mean: float = SHAREGPT_INPUT_MEAN,
              output_mean: float = SHAREGPT_OUTPUT_MEAN, sigma: float = SHAREGPT_SIGMA,
              max_len: int = SHAREGPT_MAX_LEN) -> list[SimRequest]:
    arrivals = poisson_arrivals(rng, n, rate_rps)
    return _sharegpt_requests(rng, "sharegpt", arrivals, input_mean, output_mean, sigma, max_len)


def _bursty(rng: np.random.Generator, n: int, rate_rps: float, gamma_shape: float = 0.1,
            input_mean: float = SHAREGPT_INPUT_MEAN, output_mean: float = SHAREGPT_OUTPUT_MEAN,
            sigma: float = SHAREGPT_SIGMA, max_len: int = SHAREGPT_MAX_LEN) -> list[SimRequest]:
    arrivals = gamma_arrivals(rng, n, rate_rps, gamma_shape)
    return _sharegpt_requests(rng, "bursty", arrivals, input_mean, output_mean, sigma, max_len)


# llm-d's shared-prefix benchmark (its precise prefix-cache scorer, 2025-09): customer
# groups, each a 6,000-token system prefix shared by its users' 1,200-token questions. Its
# 150 groups needed 73% of that cluster's KV; benchmarks/routing/setup.py sizes num_groups the
# same way for the simulated cluster (B2B_KV_SHARE of its KV), so that one replica cannot
# hold every group but the cluster can hold each group once.
B2B_NUM_GROUPS = 150
B2B_PREFIX_LEN = 6000
B2B_QUESTION_LEN = 1200
B2B_OUTPUT_LEN = 256
B2B_KV_SHARE = 0.73


def _b2b(rng: np.random.Generator, n: int, rate_rps: float, num_groups: int = B2B_NUM_GROUPS,
         prefix_len: int = B2B_PREFIX_LEN, question_len: int = B2B_QUESTION_LEN,
         output_len: int = B2B_OUTPUT_LEN, warmup_s: float = 0.0,
         warmup_max_tokens: int | None = None, sessions: bool = True) -> list[SimRequest]:
    """sessions=False: the requests carry no session id (clients that name no user or
    conversation), so a router can place a group only by its prefix."""
    # Questions and answers vary +-50% around their means (uniform): distinct, similar size.
    out = _shared_prefix_requests(
        rng, "b2b", "group", n, rate_rps, num_groups, prefix_len,
        lambda rng, n: (around(rng, question_len, n), around(rng, output_len, n)), warmup_s, warmup_max_tokens,
    )
    return out if sessions else [replace(r, session_id=None) for r in out]


# Agentic sessions: a system prompt + tools, then turns that each append the previous
# answer (as the client re-sends it) and a new message / tool result to the history. Tool
# results are long and answers (tool calls) short: a session's prompt grows from ~3k to
# ~16k tokens (mean ~9.5k) with 160-token answers, the shape of agent traces such as
# Mooncake's tool-agent trace (high reuse, cache ratio ~59%). Round robin re-sends each
# history to a replica that saw an older turn, or none; and every replica it visits
# keeps its own copy of the history.
AGENTIC_TURNS = 12
AGENTIC_SYSTEM_LEN = 2048
AGENTIC_TURN_LEN = 1024
AGENTIC_OUTPUT_LEN = 160
AGENTIC_THINK_S = 2.0


def _agentic(rng: np.random.Generator, n: int, rate_rps: float, turns: int = AGENTIC_TURNS,
             system_len: int = AGENTIC_SYSTEM_LEN, turn_len: int = AGENTIC_TURN_LEN,
             output_len: int = AGENTIC_OUTPUT_LEN, think_s: float = AGENTIC_THINK_S,
             warmup_s: float = 0.0, pause_s: tuple[float, float] | None = None,
             answer: Callable[[tuple[int, ...], int], tuple[int, ...]] | None = None) -> list[SimRequest]:
    """Sessions start as a Poisson process at rate_rps / turns (so requests arrive at
    ~rate_rps overall); turn k+1 arrives think time (exponential, mean think_s) after turn
    k's arrival: open loop, it does not wait for turn k's answer. `pause_s` = (low, high):
    tool pauses instead, each drawn log-uniform in [low, high] seconds (an agent waiting on
    its tool calls: seconds to minutes), counted from turn k's END (closed loop: the turn
    names its predecessor, cluster/sim/follow_ups.py); arrival_s is then the estimate
    pause + the previous estimate. `answer(history, n)`: the n tokens the simulated engine
    answers `history` with (worker/sim/runner.py's tokens are a function of the history),
    re-sent in the next turn as a real client re-sends the answer it got. The answer re-sent in
    the history is the workload's own draw, not the tokens the simulated engine produced,
    so a turn's cache hit covers the previous prompt, not the previous answer (a real
    client re-sends the answer the engine did produce; that part would hit as well).

    warmup_s > 0: the turns that arrive before warmup_s are warm-up requests (served, not
    measured; `n` counts the measured ones), so the measured window starts with sessions
    already in flight, as a long-running cluster has them, instead of an empty cluster."""
    num_sessions = -(-n // turns)
    starts = list(poisson_arrivals(rng, num_sessions, rate_rps / turns))
    out: list[SimRequest] = []
    measured = 0
    s = 0
    while measured < n:
        if s == len(starts):  # warm-up turns took some of the sessions' requests: more sessions
            starts.append(starts[-1] + float(rng.exponential(turns / rate_rps)))
        history = _tokens(rng, system_len)
        t = float(starts[s])
        for k in range(turns):
            if measured == n:
                break
            history = history + _tokens(rng, around(rng, turn_len))
            max_tokens = int(around(rng, output_len))
            warm = t < warmup_s
            follow = {} if pause_s is None or k == 0 else {"after": f"agentic-{s}-{k - 1}", "pause_s": pause}
            out.append(SimRequest(f"agentic-{s}-{k}", t, history, max_tokens, session_id=f"session-{s}", warmup=warm,
                                  **follow))  # type: ignore[arg-type]
            measured += not warm
            # The answer, as the client re-sends it.
            history = history + (answer(history, max_tokens) if answer is not None else _tokens(rng, max_tokens))
            pause = log_uniform(rng, *pause_s) if pause_s is not None else float(rng.exponential(think_s))
            t += pause
        s += 1
    return out


# Long-context code assistance: a repository context (shared by the requests on that
# repository) plus the open files and the question; answers are short edits.
CODE_NUM_REPOS = 8
CODE_REPO_LEN = 16384
CODE_FILES_MEAN = 8192
CODE_OUTPUT_MEAN = 96
CODE_MAX_LEN = 65536


def _code(rng: np.random.Generator, n: int, rate_rps: float, num_repos: int = CODE_NUM_REPOS,
          repo_len: int = CODE_REPO_LEN, files_mean: float = CODE_FILES_MEAN,
          output_mean: float = CODE_OUTPUT_MEAN, max_len: int = CODE_MAX_LEN) -> list[SimRequest]:
    return _shared_prefix_requests(
        rng, "code", "repo", n, rate_rps, num_repos, repo_len,
        lambda rng, n: (lognormal_lengths(rng, n, files_mean, 0.8, 256, max(256, max_len - repo_len - 1)),
                        lognormal_lengths(rng, n, output_mean, 0.8, 1, 1024)),
    )


def _trace(rng: np.random.Generator, n: int, rate_rps: float, path: str | Path = "",
           block_tokens: int = MOONCAKE_BLOCK_TOKENS, time_scale: float = 1.0,
           scale_to_rate: bool = False) -> list[SimRequest]:
    """Replay a JSONL trace: one object per line with `timestamp` (ms, as in the Mooncake
    traces), `input_length`, `output_length` and `hash_ids` (one id per `block_tokens`
    prompt tokens; equal ids mean equal content). Each hash id expands to the same
    block_tokens random tokens everywhere (seeded by (seed draw, id)), so requests sharing
    leading hash ids share that prefix token for token. `time_scale` multiplies the gaps
    (0.5 replays twice as fast); `rate_rps` is ignored unless `scale_to_rate`: then the gaps
    are scaled (on top of time_scale) so that the slice's mean arrival rate is rate_rps,
    its bursts and lulls kept in proportion (a rate search over the trace's own shape)."""
    if not path:
        raise ValueError("the trace workload needs path=<JSONL file>")
    base = int(rng.integers(0, 2**31))
    blocks: dict[int, tuple[int, ...]] = {}

    def block(hash_id: int) -> tuple[int, ...]:
        if hash_id not in blocks:
            blocks[hash_id] = _tokens(np.random.default_rng([base, hash_id]), block_tokens)
        return blocks[hash_id]

    out: list[SimRequest] = []
    t0: float | None = None
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if len(out) == n:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts, input_len, output_len = float(rec["timestamp"]), int(rec["input_length"]), int(rec["output_length"])
                hash_ids = [int(h) for h in rec.get("hash_ids", [])]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a trace record ({e})") from None
            t0 = ts if t0 is None else t0
            prompt: tuple[int, ...] = ()
            for h in hash_ids:
                prompt += block(h)
            # The last hash block is usually partial; lengths beyond the hash ids are fresh.
            prompt = prompt[:input_len] + (_tokens(rng, input_len - len(prompt)) if len(prompt) < input_len else ())
            out.append(SimRequest(f"trace-{len(out)}", (ts - t0) / 1000.0 * time_scale, prompt, max(1, output_len)))
    if not out:
        raise ValueError(f"{path}: the trace holds no requests")
    span = out[-1].arrival_s
    if scale_to_rate and rate_rps > 0 and span > 0 and len(out) > 1:
        k = (len(out) - 1) / (rate_rps * span)
        out = [replace(r, arrival_s=r.arrival_s * k) for r in out]
    return out


# LoRA fleet (S-LoRA's and Punica's setting): many adapters of one base model, a few hot,
# most rarely used. Popularity follows Zipf's law over the adapters' rank k (k = 1 the
# most popular): p(k) = k**-s / sum_j j**-s.
LORA_NUM_ADAPTERS = 64
LORA_ZIPF_S = 1.0


def lora_adapter_name(k: int) -> str:
    """The name of the adapter of popularity rank k (0: the most popular)."""
    return f"lora-{k:03d}"


def zipf_probabilities(num: int, s: float) -> np.ndarray:
    weights = np.arange(1, num + 1, dtype=float) ** -s
    return weights / weights.sum()


def _lora(rng: np.random.Generator, n: int, rate_rps: float, num_adapters: int = LORA_NUM_ADAPTERS,
          zipf_s: float = LORA_ZIPF_S, input_mean: float = SHAREGPT_INPUT_MEAN,
          output_mean: float = SHAREGPT_OUTPUT_MEAN, sigma: float = SHAREGPT_SIGMA,
          max_len: int = SHAREGPT_MAX_LEN, warmup_s: float = 0.0) -> list[SimRequest]:
    """ShareGPT requests (Poisson arrivals), each for one of `num_adapters` adapters drawn
    with Zipf popularity (exponent `zipf_s`).

    warmup_s > 0: first, warmup_s seconds of the same traffic (rate x warmup_s more
    requests, measured by no figure), so that the measured requests meet replicas whose
    slots and host memory hold adapters and whose batches run, as in a long-running
    cluster, instead of a cold start where every replica loads its first adapters at once."""
    if num_adapters < 1 or zipf_s < 0 or warmup_s < 0:
        raise ValueError("num_adapters must be >= 1, zipf_s >= 0 and warmup_s >= 0")
    num_warmup = round(rate_rps * warmup_s)
    total = n + num_warmup
    arrivals = poisson_arrivals(rng, total, rate_rps)
    requests = _sharegpt_requests(rng, "lora", arrivals, input_mean, output_mean, sigma, max_len)
    ranks = rng.choice(num_adapters, size=total, p=zipf_probabilities(num_adapters, zipf_s))
    return [replace(r, lora_name=lora_adapter_name(int(k)), warmup=i < num_warmup,
                    request_id=f"lora-warmup-{i}" if i < num_warmup else f"lora-{i - num_warmup}")
            for i, (r, k) in enumerate(zip(requests, ranks))]


WORKLOADS: dict[str, Callable[..., list[SimRequest]]] = {
    "sharegpt": _sharegpt,
    "b2b": _b2b,
    "agentic": _agentic,
    "code": _code,
    "bursty": _bursty,
    "trace": _trace,
    "lora": _lora,
}
WORKLOAD_NAMES: tuple[str, ...] = tuple(WORKLOADS)
