"""The work a replica has queued, in seconds of that replica's time (pure; no Ray).

KV usage hides queued work, and request counts hide request sizes (a 32k-token prompt and a
chat turn are "one request"). So the headroom ranking (router/ranking.py) counts work:

    rate(r)       = r's reported prefill_tokens_per_s if it measured one (prompt tokens
                    per device second over its recent budget-full steps, decodes beside
                    them included: worker/step_meters.py), else
                    params.prefill_tokens_per_s * capacity_weight(r)
                    (capacity_weight: r's device throughput relative to the reference
                    device the parameter describes; 1 for the reference)
    backlog(r)    = num_waiting_prompt_tokens(r)           # queued at r's last report
                    + unreflected_prefill_tokens(r)        # uncached tokens sent since
    uncached(q,r) = prompt_len(q) - cached_tokens(q, r)
    ttft(q, r)    = (backlog(r) + uncached(q, r)) / rate(r) # predicted prefill wait

    within_target(q, r) = backlog(r) + uncached(q, r) <= rate(r) * target_ttft_s

`within_target` is the affinity release: a replica that caches the prompt keeps getting it
while what it has queued, this request included, can be prefilled within the target TTFT;
beyond that the request spreads (router/ranking.py ranks by predicted TTFT then).

Decode work enters through the ledger's decode_blocks (the KV a request will still grow
into, counted against the headroom from dispatch time), then, once a report reflects the
request, through that report's decode_growth_blocks (router/ranking.py's capacity), and
through the queue-depth gate: once decodes fill a replica's batch, new requests wait in its
queue, which the report shows as num_waiting.
"""
from __future__ import annotations

from router.headroom import HeadroomParams, ReplicaReport, ReplicaView, RequestProfile


def prefill_rate(report: ReplicaReport, params: HeadroomParams) -> float:
    """Prompt tokens per second the replica prefills (always > 0)."""
    if report.prefill_tokens_per_s > 0:
        return report.prefill_tokens_per_s
    return params.prefill_tokens_per_s * report.capacity_weight


def prefill_backlog(view: ReplicaView) -> int:
    """Prompt tokens queued there: at the report, plus those sent since (uncached ones)."""
    assert view.report is not None
    return view.report.num_waiting_prompt_tokens + view.unreflected_prefill_tokens


def uncached_tokens(request: RequestProfile, cached_blocks: int, block_size: int) -> int:
    return max(request.prompt_len - cached_blocks * block_size, 0)


def predicted_ttft_s(backlog: int, uncached: int, rate: float) -> float:
    """Seconds until this request's prefill is done, if the replica prefills its queue first."""
    return (backlog + uncached) / rate


def within_target(backlog: int, uncached: int, rate: float, params: HeadroomParams) -> bool:
    return backlog + uncached <= rate * params.target_ttft_s
