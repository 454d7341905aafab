"""transformers as the peers kvserve's engine is measured against: static batching
(`generate` on fixed groups) and continuous batching (the manager behind `generate_batch`).

Each peer takes a loaded model, the prompts (token ids), each prompt's max_tokens and the
batching settings, and returns a PeerRun: the tokens and the timed region's wall and CPU
seconds. Decoding is greedy with EOS ignored, so every request produces exactly its
max_tokens (what makes useful-token counts comparable across systems). A warm-up on
`warmup_prompts` runs before the timed region, untimed.

Continuous batching runs at one of two settings (CB_SETTINGS), and the benchmarks report
both: "defaults" is transformers' own ContinuousBatchingConfig (page size, CUDA graphs,
async batching and the switch to flash attention all as transformers chooses: its authors'
best settings), "matched" is kvserve's KV layout (16-token pages) with graphs, async
batching and the flash switch off, the attention as loaded.

Used by benchmarks/engine.py (the CPU side-by-side report) and reusable on a GPU: load
with `load_hf_model(..., device="cuda")`; inputs are moved to the model's device.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


CB_SETTINGS = ("defaults", "matched")
# What "matched" sets; "defaults" sets none of these (transformers decides).
_MATCHED = {"page_size": 16, "use_cuda_graph": False, "use_async_batching": False, "auto_switch_to_flash": False}


def cb_page_size(settings: str) -> int:
    """Tokens per KV page of continuous batching at `settings` (transformers' default for
    "defaults", read from its config class, never copied)."""
    if settings == "matched":
        return int(_MATCHED["page_size"])
    from transformers import ContinuousBatchingConfig

    return int(ContinuousBatchingConfig().page_size)


@dataclass
class PeerRun:
    """One peer's timed run over a list of prompts."""

    tokens: list[list[int]]  # per prompt (same order): its first max_tokens generated tokens
    generated_tokens: int  # tokens the peer computed, discarded ones included
    wall_s: float
    cpu_s: float  # process CPU time over the timed region (all threads)
    note: str  # how the peer ran, for the report


def load_hf_model(
    model_dir: Path, attn_implementation: str, dtype: torch.dtype = torch.float32, device: str | None = None
) -> Any:
    """The model in eval mode; `device` None leaves it where from_pretrained put it (CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model


def pad_id_of(model: Any) -> int:
    for value in (model.config.pad_token_id, model.generation_config.pad_token_id):
        if isinstance(value, int):
            return value
    return 0


def disable_eos(model: Any) -> None:
    """No EOS at all: `generate` then never marks a row finished, so a group runs to its
    longest request (what ignore_eos does in the engine). Passing eos_token_id=None to
    generate() would be refilled from the model's defaults, hence on the model itself."""
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None


def _static_group(model: Any, prompts: Sequence[Sequence[int]], max_new: int, pad: int) -> torch.Tensor:
    """One `generate` call on a left-padded group; the [group, max_new] new tokens."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        n = len(prompt)
        ids[row, width - n:] = torch.tensor(prompt)
        mask[row, width - n:] = 1
    config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=0, do_sample=False,
                              pad_token_id=pad, eos_token_id=None)
    with torch.inference_mode():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config)
    new = out[:, width:]
    if new.shape[1] != max_new:
        raise RuntimeError(f"hf_static stopped after {new.shape[1]} of {max_new} tokens")
    return new


def static_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    batch_size: int,
    warmup_prompts: Sequence[Sequence[int]] = (),
) -> PeerRun:
    """`generate` on groups of `batch_size` prompts in order, max_new_tokens = the group's
    longest request; tokens past a prompt's own max_tokens are computed but discarded.
    Disables the model's EOS (see disable_eos)."""
    pad = pad_id_of(model)
    disable_eos(model)
    if warmup_prompts:
        _static_group(model, warmup_prompts, 4, pad)  # warm-up, untimed

    tokens: list[list[int]] = []
    generated = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for g in range(0, len(prompts), batch_size):
        group_max = list(max_tokens[g: g + batch_size])
        new = _static_group(model, prompts[g: g + batch_size], max(group_max), pad)
        generated += new.numel()
        tokens.extend(new[row, :n].tolist() for row, n in enumerate(group_max))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    useful = sum(max_tokens)
    note = (
        f"{math.ceil(len(prompts) / batch_size)} groups of {batch_size}; computed {generated} "
        f"tokens, {useful} useful ({1 - useful / generated:.0%} discarded past a request's max_tokens)"
    )
    return PeerRun(tokens, generated, wall, cpu, note)


def cb_num_blocks(max_requests: int, max_model_len: int, page_size: int) -> int:
    """KV pages for continuous batching: enough for `max_requests` in-flight requests of
    max_model_len, x2 headroom above the 15% safety margin HF's FIFO scheduler keeps free."""
    return 2 * max_requests * math.ceil(max_model_len / page_size)


def continuous_batching_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    max_requests_per_batch: int,
    max_batch_tokens: int,
    num_blocks: int,
    settings: str = "defaults",
    api: str = "manager",
    warmup_prompts: Sequence[Sequence[int]] = (),
) -> PeerRun:
    """transformers' continuous batching at `settings` (CB_SETTINGS; the batch size, token
    budget and page count are the benchmark's, the same for every system). api "manager":
    the manager `generate_batch` uses (`continuous_batching_context_manager`), each request
    added with its own max_new_tokens (no wasted tokens); api "generate_batch":
    `generate_batch` itself, which takes ONE max_new_tokens for all requests (the longest),
    counting only the useful tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    if settings not in CB_SETTINGS:
        raise ValueError(f"settings must be one of {CB_SETTINGS}, got {settings!r}")
    pad = pad_id_of(model)
    cb_config = ContinuousBatchingConfig(
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        **(_MATCHED if settings == "matched" else {}),
    )
    # eos_token_id=-1 disables stopping on EOS (HF's own convention for "no EOS").
    gen_config = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=False, pad_token_id=pad,
                                  eos_token_id=-1)
    if api == "generate_batch":
        run = _cb_generate_batch(model, prompts, max_tokens, gen_config, cb_config, pad, warmup_prompts)
    else:
        run = _cb_manager(model, prompts, max_tokens, gen_config, cb_config, warmup_prompts)
    def shown(value: Any) -> str:  # None: transformers decides at start (off without CUDA graphs)
        return "auto" if value is None else str(value)

    run.note += (f"; settings {settings}: page_size {cb_config.page_size}, CUDA graphs "
                 f"{shown(cb_config.use_cuda_graph)}, async batching {shown(cb_config.use_async_batching)}")
    return run


def _cb_generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    gen_config: Any,
    cb_config: Any,
    pad: int,
    warmup_prompts: Sequence[Sequence[int]],
) -> PeerRun:
    from transformers import GenerationConfig

    if warmup_prompts:
        model.generate_batch(inputs=[list(p) for p in warmup_prompts], generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, pad_token_id=pad, eos_token_id=-1),
            continuous_batching_config=cb_config)  # warm-up, untimed
    start, cpu_start = time.perf_counter(), time.process_time()
    results = model.generate_batch(inputs=list(prompts), generation_config=gen_config,
                                   continuous_batching_config=cb_config)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    ordered = list(results.values())
    if len(ordered) != len(prompts):
        raise RuntimeError(f"hf_cb returned {len(ordered)} of {len(prompts)} results")
    tokens: list[list[int]] = []
    generated = 0
    for n, res in zip(max_tokens, ordered):
        if res.error:
            raise RuntimeError(f"hf_cb failed a request: {res.error}")
        generated += len(res.generated_tokens)
        tokens.append(list(res.generated_tokens[:n]))
    note = (
        f"generate_batch with one max_new_tokens={max(max_tokens)} for all requests (it takes no "
        f"per-request limit); computed {generated} tokens, counted only the useful ones"
    )
    return PeerRun(tokens, generated, wall, cpu, note)


def _cb_manager(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    gen_config: Any,
    cb_config: Any,
    warmup_prompts: Sequence[Sequence[int]],
) -> PeerRun:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                          max_generated_length=max(max_tokens), num_requests=len(prompts))
    request_ids = [f"peer-{i}" for i in range(len(prompts))]
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=30,
        warmup=False, workload_hints=hints,
    ) as manager:
        warm = {manager.add_request(list(p), request_id=f"warmup-{i}", max_new_tokens=4, eos_token_id=-1)
                for i, p in enumerate(warmup_prompts)}
        _drain(manager, warm)  # warm-up, untimed
        attention = model.config._attn_implementation  # as switched by the manager (restored on exit)
        start, cpu_start = time.perf_counter(), time.process_time()
        for request_id, prompt, n in zip(request_ids, prompts, max_tokens):
            manager.add_request(list(prompt), request_id=request_id, max_new_tokens=n, eos_token_id=-1)
        results = _drain(manager, set(request_ids))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens: list[list[int]] = []
    generated = 0
    for request_id, n in zip(request_ids, max_tokens):
        res = results[request_id]
        if res.error:
            raise RuntimeError(f"hf_cb failed {request_id}: {res.error}")
        generated += len(res.generated_tokens)
        tokens.append(list(res.generated_tokens))
        if len(res.generated_tokens) != n:
            raise RuntimeError(f"hf_cb gave {len(res.generated_tokens)} tokens for {request_id}, expected {n}")
    note = (
        "per-request max_new_tokens through the manager generate_batch uses "
        f"(generate_batch itself takes one max_new_tokens for all); attention {attention}"
    )
    return PeerRun(tokens, generated, wall, cpu, note)


def _drain(manager: Any, ids: set[str]) -> dict[str, Any]:
    """Waits for every request in `ids` to finish; the finished results by id."""
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        res = manager.get_result(timeout=1)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("hf_cb generation thread stopped")
            continue
        if res.is_finished() and res.request_id in ids:
            done[res.request_id] = res
    return done


def reference_generate(model: Any, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
    """Per-prompt greedy `generate` (no padding, no batching): a correctness reference.
    Disables the model's EOS (see disable_eos)."""
    pad = pad_id_of(model)
    disable_eos(model)
    tokens: list[list[int]] = []
    for prompt, n in zip(prompts, max_tokens):
        ids = torch.tensor([list(prompt)], device=model.device)
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=pad)
        tokens.append(gen[0, ids.shape[1]:].tolist())
    return tokens
