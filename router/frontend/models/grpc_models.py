"""The KVServe gRPC service when an ingress serves several models: each RPC goes to the
servicer of the model its request names (`model`, as HTTP's field; an adapter picks its
base model), with the same key limits and the same 404 (NOT_FOUND) for a model the key may
not use. ListModels, Health and Stats cover every model the caller may see."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from protos.kvserve.v1 import kvserve_pb2 as pb
from router import errors
from router.frontend.grpc_api.servicer import GrpcServicer, _fail, _unary
from router.frontend.models.directory import ModelDirectory

if TYPE_CHECKING:
    from ray.serve.grpc_util import RayServegRPCContext


class ModelsGrpc:
    def __init__(self, directory: ModelDirectory) -> None:
        self.directory = directory

    async def _servicer(self, model: str, grpc_context: RayServegRPCContext | None) -> GrpcServicer:
        principal = self.directory.default.grpc._authenticate(grpc_context)  # the keys are shared
        return (await self.directory.find(model, principal)).grpc

    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None = None) -> pb.GenerateResponse:
        return await _unary(grpc_context, pb.GenerateResponse(), self._generate(request, grpc_context))

    async def _generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None) -> pb.GenerateResponse:
        return await (await self._servicer(request.model, grpc_context))._generate(request, grpc_context)

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            servicer = await self._servicer(request.model, grpc_context)
        except errors.APIError as e:
            raise _fail(grpc_context, e) from None
        async with aclosing(servicer.GenerateStream(request, grpc_context)) as messages:
            async for message in messages:
                yield message

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext | None = None) -> pb.TokenizeResponse:
        return await _unary(grpc_context, pb.TokenizeResponse(), self._tokenize(request, grpc_context))

    async def _tokenize(self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext | None) -> pb.TokenizeResponse:
        return await (await self._servicer(request.model, grpc_context))._tokenize(request, grpc_context)

    async def ListModels(
        self, request: pb.ListModelsRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.ListModelsResponse:
        return await _unary(grpc_context, pb.ListModelsResponse(), self._list_models(grpc_context))

    async def _list_models(self, grpc_context: RayServegRPCContext | None) -> pb.ListModelsResponse:
        principal = self.directory.default.grpc._authenticate(grpc_context)
        response = pb.ListModelsResponse()
        for serving in self.directory.allowed(principal):
            response.models.extend((await serving.grpc._list_models(grpc_context)).models)
        return response

    async def Health(self, request: pb.HealthRequest, grpc_context: RayServegRPCContext | None = None) -> pb.HealthResponse:
        for serving in self.directory.servings.values():
            answer = await serving.grpc.Health(request, grpc_context)
            if answer.status != pb.HealthResponse.STATUS_SERVING:
                answer.message = f"model {serving.name}: {answer.message}"
                return answer
        return pb.HealthResponse(status=pb.HealthResponse.STATUS_SERVING)

    async def Stats(self, request: pb.StatsRequest, grpc_context: RayServegRPCContext | None = None) -> pb.StatsResponse:
        return await _unary(grpc_context, pb.StatsResponse(), self._stats(grpc_context))

    async def _stats(self, grpc_context: RayServegRPCContext | None) -> pb.StatsResponse:
        """Every model's replicas (each under its pool's name prefixed by its model's) and
        the sums over them; the ingress's in-flight counts over every model."""
        merged = pb.StatsResponse()
        for serving in self.directory.servings.values():
            part = await serving.grpc._stats(grpc_context)
            for replica in part.replicas:
                replica.pool = f"{serving.name}/{replica.pool}" if replica.pool else serving.name
            merged.replicas.extend(part.replicas)
            for field in ("ingress_in_flight", "ingress_max_in_flight", "free_blocks", "total_blocks",
                          "free_tokens", "num_running", "num_waiting"):
                setattr(merged, field, getattr(merged, field) + getattr(part, field))
            merged.timestamp = part.timestamp
        return merged
