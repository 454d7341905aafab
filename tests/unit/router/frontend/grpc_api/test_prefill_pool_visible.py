"""Disaggregated, the prefill pool is visible where the decode pool is: /metrics (series
labelled pool="prefill"), /health and gRPC Health (down when either pool is down), and gRPC
Stats (each replica with its pool). The real ingress pipeline, metrics and gRPC servicer
over fake handles of the two pools (no Ray)."""
from __future__ import annotations

from typing import Any

from protos.kvserve.v1 import kvserve_pb2 as pb
from router.frontend.auth import ApiKeys
from router.frontend.grpc_api.servicer import GrpcServicer
from router.frontend.key_limits import KeyLimits
from router.frontend.metrics import IngressMetrics
from router.frontend.pipeline import RequestPipeline
from router.frontend.settings import IngressSettings
from router.frontend.workers import Workers
from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeIngress, FakeTokenizer, FakeWorker


class PoolWorker(FakeWorker):
    """A pool's handle whose replicas answer `stats` with `replica_stats`."""

    def __init__(self, replica_stats: list[dict[str, Any]]) -> None:
        super().__init__()
        self.replica_stats = replica_stats

    def broadcast(self, method: str) -> Any:
        assert method == "stats"
        stats = self.replica_stats

        class _Results:
            async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
                return [dict(s) for s in stats]

        return _Results()


PREFILL = [{"replica_id": "p1", "free_blocks": 30, "total_blocks": 40, "block_size": 16, "num_running": 0,
            "num_waiting": 3, "num_waiting_prompt_tokens": 900, "kv_usage": 0.25}]
DECODE = [{"replica_id": "d1", "free_blocks": 10, "total_blocks": 40, "block_size": 16, "num_running": 5,
           "num_waiting": 1, "kv_usage": 0.75},
          {"replica_id": "d2", "free_blocks": 20, "total_blocks": 40, "block_size": 16, "num_running": 2,
           "num_waiting": 0, "kv_usage": 0.5}]


class DisaggIngress(FakeIngress):
    def __init__(self) -> None:  # as router/frontend/ingress.py builds it with a prefill pool
        settings = IngressSettings(served_model_name="tiny", tokenizer_path="/models/tiny", request_timeout_s=30.0)
        self.prefill, self.worker = PoolWorker(PREFILL), PoolWorker(DECODE)
        workers = Workers(self.worker, self.worker, settings.stats_timeout_s, prefill_handle=self.prefill)
        self.pipeline = RequestPipeline(settings, workers, FakeTokenizer(), IngressMetrics("tiny", "ing-1"),
                                        ApiKeys([]), KeyLimits())
        self.grpc = GrpcServicer(self.pipeline)


async def test_metrics_show_both_pools() -> None:
    ingress = DisaggIngress()
    text = ingress.pipeline.metrics.render(await ingress.pipeline.workers.stats()).decode()
    assert 'kvserve:num_requests_waiting{ingress_replica="ing-1",model_name="tiny",pool="prefill",replica="p1"} 3.0' in text
    assert 'kvserve:num_requests_running{ingress_replica="ing-1",model_name="tiny",pool="decode",replica="d1"} 5.0' in text
    assert 'kvserve:cluster_num_replicas{ingress_replica="ing-1",model_name="tiny"} 3.0' in text


async def test_grpc_stats_name_each_replicas_pool() -> None:
    stats = await DisaggIngress().Stats(pb.StatsRequest())
    assert [(r.pool, r.replica_id) for r in stats.replicas] == [("decode", "d1"), ("decode", "d2"), ("prefill", "p1")]
    assert (stats.num_running, stats.num_waiting, stats.total_blocks) == (7, 4, 120)
    assert stats.replicas[2].num_waiting_prompt_tokens == 900


async def test_health_needs_both_pools() -> None:
    ingress = DisaggIngress()
    assert (await ingress.Health(pb.HealthRequest())).status == pb.HealthResponse.STATUS_SERVING
    ingress.prefill.healthy = False
    ingress.pipeline.workers.health.expire()  # the verdict is cached for a second
    health = await ingress.Health(pb.HealthRequest())
    assert health.status == pb.HealthResponse.STATUS_NOT_SERVING
    assert health.message.startswith("prefill pool: No healthy worker")
    ingress.prefill.healthy, ingress.worker.healthy = True, False
    ingress.pipeline.workers.health.expire()
    assert (await ingress.Health(pb.HealthRequest())).message.startswith("decode pool:")


async def test_one_pool_keeps_its_unlabelled_series() -> None:
    """Without disaggregation nothing changes: no `pool` label, no pool in Stats."""
    ingress = FakeIngress()
    text = ingress.pipeline.metrics.render(await ingress.pipeline.workers.stats()).decode()
    assert 'kvserve:num_requests_running{model_name="tiny",replica="b"} 1.0' in text
    assert all(r.pool == "" for r in (await ingress.Stats(pb.StatsRequest())).replicas)
