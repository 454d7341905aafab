"""The standard gRPC services next to KVServe, with real grpcio clients: grpc.health.v1
(Check, and Watch across a drain) answering in Serve's gRPC proxy with the app's own
verdict, server reflection listing the services, and TLS / mutual TLS with certificates
generated here.

The TLS tests run router/frontend/grpc_api/tls.py's port on a grpc.aio server of their own: the
session's Serve instance started without TLS settings, and Serve's proxy reads them from
the node's environment when it starts (router/frontend/grpc_api/tls.py)."""
from __future__ import annotations

import asyncio
import datetime
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from router.frontend.grpc_api.health import KVSERVE_SERVICE, add_health_servicer
from router.frontend.grpc_api.tls import TLSConfig, add_tls_port
from tests.integration.conftest import free_port
from tests.integration.tiny_app import tiny_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

APP = "grpc-standard"
MODEL = "kv-tiny-grpc-std"
WAIT_S = 120.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def channel(serve_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpc.Channel]:
    from ray import serve

    from cluster.app import build_app
    from tests.support.tiny_served_model import make_served_model

    model_dir = make_served_model(tmp_path_factory.mktemp("served") / "tiny")
    serve.run(build_app(tiny_config(APP, model_dir, MODEL)), name=APP, route_prefix=f"/{APP}")
    ch = grpc.insecure_channel(f"127.0.0.1:{serve_cluster.grpc_port}")
    try:
        yield ch
    finally:
        ch.close()
        serve.delete(APP)


def check(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_check_follows_the_app(channel: grpc.Channel) -> None:
    # The proxy's probe asks the app every second: SERVING once the app answers.
    wait_until(lambda: check(channel) == SERVING, WAIT_S, message="grpc.health.v1 to report SERVING")
    assert check(channel, KVSERVE_SERVICE) == SERVING
    with pytest.raises(grpc.RpcError) as info:
        check(channel, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_kvserve_and_health(channel: grpc.Channel) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {KVSERVE_SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    # The descriptors travel too: a client can build requests from reflection alone.
    method = DescriptorPool(db).FindServiceByName(KVSERVE_SERVICE).FindMethodByName("Generate")
    assert method.input_type.full_name == "kvserve.v1.GenerateRequest"


# -- n, logit_bias and stop_token_ids on KVServe -------------------------------------------------
def test_n_choices_unary_and_stream(channel: grpc.Channel) -> None:
    stub = pb_grpc.KVServeStub(channel)
    req = pb.GenerateRequest(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=3, n=3, ignore_eos=True)
    reply = stub.Generate(req, timeout=120)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == pb.FINISH_REASON_LENGTH for c in reply.choices)
    assert reply.text == reply.choices[0].text and list(reply.token_ids) == list(reply.choices[0].token_ids)
    assert reply.usage.completion_tokens == 15
    # Seeded choices (seed + index) are reproducible: the stream carries the same ones.
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = []
    for message in stub.GenerateStream(req, timeout=120):
        streamed[message.index].extend(message.token_ids)
        if message.finish_reason:
            finished.append(message.index)
    assert sorted(finished) == [0, 1, 2]
    assert streamed == {c.index: list(c.token_ids) for c in reply.choices}


def test_n_over_the_limit_is_invalid_argument(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.KVServeStub(channel).Generate(pb.GenerateRequest(model=MODEL, prompt="x", max_tokens=2, n=1000), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be at most" in info.value.details()


def test_logit_bias_and_stop_token_ids(channel: grpc.Channel) -> None:
    stub = pb_grpc.KVServeStub(channel)
    forced = 100
    base = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    reply = stub.Generate(pb.GenerateRequest(**base, logit_bias={forced: 100.0}), timeout=60)
    assert list(reply.token_ids) == [forced] * 4
    plain = stub.Generate(pb.GenerateRequest(**base), timeout=60)
    banned = stub.Generate(pb.GenerateRequest(**base, logit_bias={plain.token_ids[0]: -100.0}), timeout=60)
    assert banned.token_ids[0] != plain.token_ids[0]
    stopped = stub.Generate(pb.GenerateRequest(**base, logit_bias={forced: 100.0}, stop_token_ids=[forced]), timeout=60)
    assert list(stopped.token_ids) == [forced]
    assert stopped.finish_reason == pb.FINISH_REASON_STOP and stopped.stop_token_id == forced
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(**base, logit_bias={forced: 101.0}), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_watch_across_a_drain(channel: grpc.Channel) -> None:
    """Runs last in the module: a drained ingress takes no new requests."""
    from ray import serve

    from cluster.app import INGRESS_DEPLOYMENT

    wait_until(lambda: check(channel) == SERVING, WAIT_S, message="grpc.health.v1 to report SERVING")
    seen: queue.Queue[int] = queue.Queue()
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=KVSERVE_SERVICE))

    def read() -> None:
        try:
            for reply in watch:
                seen.put(reply.status)
        except grpc.RpcError:
            pass  # cancelled below

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.get(timeout=30) == SERVING
        serve.get_deployment_handle(INGRESS_DEPLOYMENT, APP).begin_drain.remote().result(timeout_s=30)
        assert seen.get(timeout=30) == NOT_SERVING  # the watcher is told, without asking again
        reply = pb_grpc.KVServeStub(channel).Health(pb.HealthRequest(), timeout=10)
        assert reply.status == pb.HealthResponse.STATUS_NOT_SERVING and "draining" in reply.message
    finally:
        watch.cancel()
        reader.join(timeout=10)


# -- TLS ----------------------------------------------------------------------------------------
def _certificates(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for localhost signed by it, and a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def issue(subject: str, key: Any, issuer: x509.Name, signer: Any, ca: bool, usage: Any = None, san: str | None = None) -> Any:
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = issue("kvserve test CA", ca_key, name("kvserve test CA"), ca_key, True)
    server = issue("localhost", server_key, ca.subject, ca_key, False, ExtendedKeyUsageOID.SERVER_AUTH, "localhost")
    client = issue("client", client_key, ca.subject, ca_key, False, ExtendedKeyUsageOID.CLIENT_AUTH)
    paths = {}
    for label, cert, key in (("ca", ca, ca_key), ("server", server, server_key), ("client", client, client_key)):
        paths[f"{label}.crt"] = tmp / f"{label}.crt"
        paths[f"{label}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{label}.key"] = tmp / f"{label}.key"
        paths[f"{label}.key"].write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


async def _tls_round_trip(certs: dict[str, Path], mutual: bool) -> None:
    server = grpc.aio.server()
    servicer = add_health_servicer(server)
    await servicer.set("", SERVING)
    config = TLSConfig(free_port(), str(certs["server.crt"]), str(certs["server.key"]),
                       str(certs["ca.crt"]) if mutual else None)
    port = add_tls_port(server, config)
    await server.start()
    try:
        ca = certs["ca.crt"].read_bytes()
        client_pair = (certs["client.key"].read_bytes(), certs["client.crt"].read_bytes()) if mutual else (None, None)
        creds = grpc.ssl_channel_credentials(ca, *client_pair)
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == SERVING
        # Plaintext on the TLS port fails; with mutual TLS, so does a client without a certificate.
        async with grpc.aio.insecure_channel(f"localhost:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        if mutual:
            async with grpc.aio.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(ca)) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_tls_round_trip_with_a_generated_certificate(tmp_path: Path, mutual: bool) -> None:
    asyncio.run(_tls_round_trip(_certificates(tmp_path), mutual))


def test_tls_config_from_the_environment(tmp_path: Path) -> None:
    env = TLSConfig(9443, "/c.pem", "/k.pem", "/ca.pem").to_env()
    assert TLSConfig.from_env(env) == TLSConfig(9443, "/c.pem", "/k.pem", "/ca.pem")
    assert TLSConfig.from_env({}) is None
    with pytest.raises(ValueError, match="KVSERVE_GRPC_TLS_CERT_FILE"):
        TLSConfig.from_env({"KVSERVE_GRPC_TLS_PORT": "9443"})
