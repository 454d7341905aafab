"""The step-cost model: how long one engine step takes on a device, from its plan.

A roofline per component, summed, plus host overheads:

    time = sum over components c of max(flops_c / (peak_flops * flops_eff_c),
                                         bytes_c / (bandwidth * bandwidth_eff))
    (flops_eff_c: the profile's flops_efficiency for the GEMMs, its attention efficiency,
    by default the same, for the two attention components)
           + step_overhead + per_seq_overhead * num_seqs + per_token_overhead * num_tokens
           + per_prompt_seq_overhead * num_prompt_seqs (rows of more than one new token)
           + after_prompt_overhead, on a decode-only step right after a step with prompt rows

Components are the kernels a step runs one after another (so their times add, while
inside one kernel compute and memory traffic overlap, so each takes the max):
- dense: every linear layer over all T tokens of the step (the engine's flat batch):
  2 * matmul_params FLOPs per token; the layer weights are read ONCE per step whatever
  T is (this is why decode batches are cheap), plus the activations each GEMM reads
  and writes;
- lm_head: only for the rows that sample (a prefill chunk that does not reach the end
  of its prompt computes no logits): 2 * vocab * hidden FLOPs per row, the head's
  weights once, the fp32 logits written and read back by the sampler; a row's `samples`
  is its number of logits rows (1 + k for a speculative verify row, worker/spec/);
- decode attention and prefill attention (rows of one new token vs more): for a
  sequence with c tokens cached and n new ones, the new tokens attend to
  n*c + n(n+1)/2 (query, key) pairs: 4 * heads * head_dim FLOPs per pair per layer
  (QK^T and PV); bytes: the whole context's KV read once, the new tokens' KV written,
  Q read and the output written. Decode rows are memory-bound and prefill rows
  compute-bound on any GPU, and backends run them as separate kernels (this engine's
  torch backend does; varlen kernels split the work by the same line), so each half
  gets its own max instead of one max hiding the other. A sliding-window layer (a shape's
  layer_windows) reads at most its window: a query at p sees min(p + 1, w) keys there, and
  the context it reads is the window's, so those layers' share of the pairs and KV bytes
  is clipped per row (all layers of a shape share one per-layer cost).
A speculative verify row (k drafts after one decode token) is a (1 + k)-token chunk over
its context with 1 + k logits rows: the weights are still read once for the step, so at
small batches it costs about one decode step and yields up to 1 + k tokens
(worker/costs/speculation.py weighs that against the acceptance rate).
Mixture-of-experts layers read the weights of the experts the step's tokens route to
(more than the active ones once T > 1) and pad each touched expert's rows to a GEMM tile;
multi-head latent attention prices decode pairs in the latent space and prefill pairs
expanded, with kv_b_proj's rebuild of the chunk's context (worker/costs/shape_parts.py).
The overheads are host work (scheduling, input building, the sampled-ids sync, output
handling) that a serial step loop adds to every step, except after_prompt_overhead: the
device's own, the caches a prompt chunk's activations took, refilled by the decode step
after it (a CPU's weights fit its caches between decode steps, not beside a prompt). Only
a runner that sees consecutive steps knows it is due (StepFeatures.follows_prompt). The simulated device counts them in
its step time either way; under the async engine's overlapped loop (worker/scheduling/async_scheduler.py)
the engine's own output handling runs beside that time instead of inside it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from worker.runner.decode_groups import padded_decode_tokens
from worker.costs.profiles import DeviceProfile
from worker.costs.shapes import ModelShape

if TYPE_CHECKING:
    from worker.scheduling.scheduler import SchedulerOutput

LOGIT_BYTES = 4  # logits are fp32 (written by the LM head, read by the sampler)
COMPONENTS = ("dense", "lm_head", "decode_attention", "prefill_attention")


@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of one step."""

    num_new_tokens: int  # 1 for a decode, the chunk length for a prefill chunk, 1 + k for a verify row
    context_len: int  # tokens already in the KV cache before this step
    # Logits rows it computes: True (1) when it reaches the end of its tokens this step, 0
    # for a prompt chunk short of it, 1 + k for a speculative verify row.
    samples: bool | int = True


@dataclass(frozen=True)
class StepFeatures:
    """What a step costs before a device is chosen: per component (FLOPs, bytes), and
    the counts the overheads scale with. `predict` turns it into seconds."""

    flops: tuple[float, ...]  # aligned with COMPONENTS
    bytes: tuple[float, ...]
    num_seqs: int
    num_tokens: int
    num_prompt_seqs: int = 0  # rows of more than one new token (prompt chunks)
    follows_prompt: bool = False  # the step before this one, on the same device, had prompt rows

    def roofline_s(self, effective_flops: float, effective_bandwidth: float,
                   effective_attention_flops: float | None = None) -> float:
        """Each component's max(compute, memory) time, summed; the attention components
        compute at `effective_attention_flops` (default: the GEMMs' rate)."""
        attention = effective_attention_flops or effective_flops
        rates = (effective_flops, effective_flops, attention, attention)  # aligned with COMPONENTS
        return sum(max(f / r, b / effective_bandwidth) for f, b, r in zip(self.flops, self.bytes, rates))


def predict(features: StepFeatures, profile: DeviceProfile) -> float:
    """Seconds for one step of these features on this device (the one formula; the
    calibration fits the profile through it too)."""
    if features.num_seqs == 0:
        return 0.0
    return (
        features.roofline_s(profile.effective_flops, profile.effective_bandwidth, profile.effective_attention_flops)
        + profile.step_overhead_s
        + profile.per_seq_overhead_s * features.num_seqs
        + profile.per_token_overhead_s * features.num_tokens
        + profile.per_prompt_seq_overhead_s * features.num_prompt_seqs
        + (profile.after_prompt_overhead_s if features.follows_prompt and not features.num_prompt_seqs else 0.0)
    )


@dataclass(frozen=True)
class RowSums:
    """The additive part of a step's rows (StepCostModel._features turns it into features).
    `decode_contexts`: each decode's context, kept only for a profile whose decode attention
    pads groups to their longest (its decode pairs and KV come from them, not the sums)."""

    num_tokens: int
    num_seqs: int
    num_sampled: int
    decode_pairs: int
    decode_kv_tokens: int
    prefill_pairs: int
    prefill_kv_tokens: int
    prefill_new: int
    num_prompt_seqs: int
    decode_contexts: list[int] | None

    def plus(self, n: int, c: int, samples: bool) -> RowSums:
        """These sums with one more row."""
        pairs = n * c + n * (n + 1) // 2
        if n == 1:
            contexts = self.decode_contexts + [c] if self.decode_contexts is not None else None
            return replace(self, num_tokens=self.num_tokens + 1, num_seqs=self.num_seqs + 1,
                           num_sampled=self.num_sampled + samples, decode_pairs=self.decode_pairs + pairs,
                           decode_kv_tokens=self.decode_kv_tokens + c + 1, decode_contexts=contexts)
        return replace(self, num_tokens=self.num_tokens + n, num_seqs=self.num_seqs + 1,
                       num_sampled=self.num_sampled + samples, prefill_pairs=self.prefill_pairs + pairs,
                       prefill_kv_tokens=self.prefill_kv_tokens + c + n, prefill_new=self.prefill_new + n,
                       num_prompt_seqs=self.num_prompt_seqs + 1)


def plan_rows(plan: SchedulerOutput) -> list[tuple[int, int, bool | int]]:
    """A plan's (new tokens, context, logits rows) rows, read before its update; a verify
    row (worker/spec/) computes logits at each of its tokens."""
    drafts = plan.draft_token_ids
    if not drafts:
        return [(n, seq.num_computed_tokens, seq.num_computed_tokens + n == seq.num_tokens)
                for seq, n in zip(plan.seqs, plan.num_new_tokens)]
    return [(n, seq.num_computed_tokens,
             n if seq.request_id in drafts else seq.num_computed_tokens + n == seq.num_tokens)
            for seq, n in zip(plan.seqs, plan.num_new_tokens)]


def _clipped_pairs(c: int, n: int, w: int) -> int:
    """sum over j < n of min(c + j + 1, w): the keys queries c .. c+n-1 read in a window w."""
    first = c + 1
    below = max(min(n, w - first), 0)  # queries that still see their whole context
    return below * first + below * (below - 1) // 2 + (n - below) * w


class StepCostModel:
    def __init__(self, shape: ModelShape, profile: DeviceProfile) -> None:
        self.shape = shape
        self.profile = profile
        s = shape
        d = s.dtype_bytes
        self._kv_bytes_per_token = s.kv_bytes_per_token()
        # Per token: FLOPs and activation bytes of the layers' GEMMs; per step: their weights.
        self._dense_flops_per_token = 2.0 * s.matmul_params
        self._dense_weight_bytes = float(s.matmul_params * s.projection_bytes)  # as held (quantized or not)
        gemm_io = 4 * s.hidden_size + 2 * s.q_size + 2 * s.kv_size + 3 * s.intermediate_size
        self._dense_act_bytes_per_token = float(s.num_layers * gemm_io * d)
        self._head_flops_per_row = 2.0 * s.lm_head_params
        self._head_weight_bytes = float(s.lm_head_params * d)
        self._head_bytes_per_row = float(s.hidden_size * d + 2 * s.vocab_size * LOGIT_BYTES)
        self._attn_flops_per_pair = 4.0 * s.num_heads * s.head_dim * s.num_layers
        self._prefill_flops_per_pair = self._attn_flops_per_pair
        self._qo_bytes_per_token = float(2 * s.q_size * s.num_layers * d)
        self._prefill_qo_bytes_per_token = self._qo_bytes_per_token
        self._expand_flops_per_token = self._expand_bytes_per_token = 0.0
        if s.mla is not None:
            self._mla_attention(s)
        self._moe_layers = 0
        if s.moe is not None:
            self._moe_weights(s)
        self._padded_decodes = profile.padded_decode_attention
        # Sliding-window layers (gpt-oss, Gemma 3) read only their window: each window's
        # share of the layers, the rest reading the whole context (worker/costs/shapes.py).
        windows = [w for w in s.layer_windows if w is not None]
        self._window_shares = tuple((w, windows.count(w) / s.num_layers) for w in sorted(set(windows)))
        self._full_share = 1.0 - len(windows) / s.num_layers

    def _mla_attention(self, s: ModelShape) -> None:
        mla, heads, layers, d = s.mla, s.num_heads, s.num_layers, s.dtype_bytes
        assert mla is not None
        self._attn_flops_per_pair = float(mla.decode_flops_per_pair(heads) * layers)
        self._prefill_flops_per_pair = float(mla.prefill_flops_per_pair(heads) * layers)
        self._qo_bytes_per_token = float(mla.decode_qo_values(heads) * layers * d)
        self._prefill_qo_bytes_per_token = float(mla.prefill_qo_values(heads) * layers * d)
        self._expand_flops_per_token = float(mla.expand_flops_per_token(heads) * layers)
        self._expand_bytes_per_token = float(2 * mla.expanded_kv_values_per_token(heads) * layers * d)

    def _moe_weights(self, s: ModelShape) -> None:
        """Split the per-step weight read into the always-read part and the routed experts."""
        moe = s.moe
        assert moe is not None
        self._moe_layers = s.num_layers - min(moe.num_dense_layers, s.num_layers)
        expert = moe.expert_params(s.hidden_size)
        self._expert_bytes = float(expert * s.dtype_bytes)
        self._expert_params = float(expert)
        active_routed = self._moe_layers * moe.num_experts_per_tok * expert
        self._dense_weight_bytes -= active_routed * s.dtype_bytes

    def _weight_bytes_and_padding(self, num_tokens: int) -> tuple[float, float]:
        """(weights read, padded-row FLOPs) of a step of `num_tokens` tokens."""
        if not self._moe_layers:
            return self._dense_weight_bytes, 0.0
        moe = self.shape.moe
        assert moe is not None
        touched = self._moe_layers * moe.expected_touched_experts(num_tokens)
        padded_rows = touched * moe.tile_rows(num_tokens) / 2  # half a tile per touched expert
        return self._dense_weight_bytes + touched * self._expert_bytes, 2.0 * self._expert_params * padded_rows

    # -- the model ---------------------------------------------------------------------------
    def features(self, work: Iterable[SeqWork]) -> StepFeatures:
        return self.rows_features((w.num_new_tokens, w.context_len, w.samples) for w in work)

    def rows_features(self, rows: Iterable[tuple[int, int, bool]], follows_prompt: bool = False) -> StepFeatures:
        """Features of (new tokens, context length, samples) rows (a runner that walks its
        plan anyway passes the rows it built); `follows_prompt`: the device's previous step
        had prompt rows."""
        return self._features(self._sums(rows), follows_prompt)

    def _sums(self, rows: Iterable[tuple[int, int, bool]]) -> RowSums:
        if self._window_shares:
            return self._windowed_sums(rows)
        return self._plain_sums(rows)

    def _windowed_sums(self, rows: Iterable[tuple[int, int, bool]]) -> RowSums:
        """Row sums with each sliding layer's share of the attention clipped to its window:
        a query at p reads min(p + 1, w) keys there (the pairs and the KV read)."""
        rows = list(rows)
        sums = self._plain_sums(rows)
        full = self._full_share
        decode_pairs = decode_kv = prefill_pairs = prefill_kv = 0.0
        for n, c, _ in rows:
            for w, share in self._window_shares:
                if n == 1:
                    keys = min(c + 1, w)
                    decode_pairs += share * keys
                    decode_kv += share * keys
                else:  # queries c .. c+n-1; the chunk reads keys from its first query's window on
                    prefill_pairs += share * _clipped_pairs(c, n, w)
                    prefill_kv += share * (min(c, w - 1) + n)
        return replace(
            sums,
            decode_pairs=full * sums.decode_pairs + decode_pairs,
            decode_kv_tokens=full * sums.decode_kv_tokens + decode_kv,
            prefill_pairs=full * sums.prefill_pairs + prefill_pairs,
            prefill_kv_tokens=full * sums.prefill_kv_tokens + prefill_kv,
        )

    def _plain_sums(self, rows: Iterable[tuple[int, int, bool]]) -> RowSums:
        # The simulator's hot path (every simulated step): plain locals, one object at the end.
        num_tokens = num_seqs = num_sampled = 0
        decode_pairs = decode_kv_tokens = 0
        prefill_pairs = prefill_kv_tokens = prefill_new = num_prompt_seqs = 0
        decode_contexts: list[int] | None = [] if self._padded_decodes else None
        for n, c, samples in rows:
            num_seqs += 1
            num_tokens += n
            num_sampled += samples
            pairs = n * c + n * (n + 1) // 2
            if n == 1:
                decode_pairs += pairs
                decode_kv_tokens += c + 1
                if decode_contexts is not None:
                    decode_contexts.append(c)
            else:
                prefill_pairs += pairs
                prefill_kv_tokens += c + n
                prefill_new += n
                num_prompt_seqs += 1
        return RowSums(num_tokens, num_seqs, num_sampled, decode_pairs, decode_kv_tokens, prefill_pairs,
                       prefill_kv_tokens, prefill_new, num_prompt_seqs, decode_contexts)

    def _features(self, sums: RowSums, follows_prompt: bool = False) -> StepFeatures:
        num_tokens, num_sampled, prefill_new = sums.num_tokens, sums.num_sampled, sums.prefill_new
        decode_pairs, decode_kv_tokens = sums.decode_pairs, sums.decode_kv_tokens
        decode_new = num_tokens - prefill_new
        if sums.decode_contexts:  # a grouped backend attends (and gathers) each group at its longest
            decode_pairs = decode_kv_tokens = padded_decode_tokens(sums.decode_contexts)
        kv = self._kv_bytes_per_token
        weights, padding = self._weight_bytes_and_padding(num_tokens)
        dense = (
            self._dense_flops_per_token * num_tokens + padding,
            weights + self._dense_act_bytes_per_token * num_tokens if num_tokens else 0.0,
        )
        head = (
            self._head_flops_per_row * num_sampled,
            self._head_weight_bytes + self._head_bytes_per_row * num_sampled if num_sampled else 0.0,
        )
        # KV: the context read once, the new tokens' KV written once (kv covers K and V).
        decode = (
            self._attn_flops_per_pair * decode_pairs,
            kv * (decode_kv_tokens + decode_new) + self._qo_bytes_per_token * decode_new,
        )
        prefill = (
            self._prefill_flops_per_pair * sums.prefill_pairs + self._expand_flops_per_token * sums.prefill_kv_tokens,
            kv * (sums.prefill_kv_tokens + prefill_new) + self._prefill_qo_bytes_per_token * prefill_new
            + self._expand_bytes_per_token * sums.prefill_kv_tokens,
        )
        parts = (dense, head, decode, prefill)
        return StepFeatures(
            flops=tuple(p[0] for p in parts), bytes=tuple(p[1] for p in parts),
            num_seqs=sums.num_seqs, num_tokens=num_tokens, num_prompt_seqs=sums.num_prompt_seqs,
            follows_prompt=follows_prompt,
        )

    def predict_beside(self, planned: Sequence[tuple[int, int, bool]]) -> Callable[[tuple[int, int, bool]], float]:
        """predict_rows(planned + [row]) as a function of one more row, the planned rows
        summed once: the step-time budget (worker/scheduling/step_budget.py) prices up to ~8 candidate
        chunks beside the same few hundred decodes each time it cuts one."""
        if self._window_shares:  # a window clips each row on its own: sum them again
            rows = list(planned)
            return lambda row: predict(self._features(self._sums([*rows, row])), self.profile)
        base = self._sums(planned)
        return lambda row: predict(self._features(base.plus(*row)), self.profile)

    def predict(self, features: StepFeatures) -> float:
        return predict(features, self.profile)

    def predict_rows(self, rows: Iterable[tuple[int, int, bool]]) -> float:
        """Seconds for a step of these (new tokens, context, samples) rows."""
        return predict(self.rows_features(rows), self.profile)

    def overhead_s(self, features: StepFeatures) -> float:
        """The host part of a step's modelled time (what a live engine also spends for real)."""
        if features.num_seqs == 0:
            return 0.0
        p = self.profile
        return (p.step_overhead_s + p.per_seq_overhead_s * features.num_seqs
                + p.per_token_overhead_s * features.num_tokens
                + p.per_prompt_seq_overhead_s * features.num_prompt_seqs)

    def step_time_s(self, work: Sequence[SeqWork]) -> float:
        return predict(self.features(work), self.profile)

    # -- from the engine's plan -----------------------------------------------------------------
    @staticmethod
    def plan_work(plan: SchedulerOutput) -> list[SeqWork]:
        """Each scheduled sequence's work; call before the step's update (it reads
        num_computed_tokens, which the update advances)."""
        return [SeqWork(*row) for row in plan_rows(plan)]

    def plan_features(self, plan: SchedulerOutput, follows_prompt: bool = False) -> StepFeatures:
        return self.rows_features(plan_rows(plan), follows_prompt)

    def plan_time_s(self, plan: SchedulerOutput) -> float:
        """step_time_s(plan_work(plan)) without building the SeqWork list (the hot path)."""
        return predict(self.plan_features(plan), self.profile)

    # -- KV sizing ---------------------------------------------------------------------------
    def block_bytes(self, block_size: int) -> int:
        """One pool block (a group's layer slots; every layer for a full-attention model)."""
        return self.shape.kv_block_bytes(block_size)

    def num_kv_blocks(self, block_size: int, memory_fraction: float = 0.9) -> int:
        """KV blocks that fit in the device's memory * fraction after the weights."""
        budget = self.profile.memory_bytes * memory_fraction - self.shape.weight_bytes
        num_blocks = int(budget // self.block_bytes(block_size))
        if num_blocks < 1:
            raise ValueError(
                f"model shape {self.shape.name!r} ({self.shape.weight_bytes / 1e9:.1f} GB of weights) leaves no "
                f"room for a KV cache on {self.profile.name} ({self.profile.memory_bytes / 1e9:.0f} GB x "
                f"{memory_fraction:g})"
            )
        return num_blocks
