"""The committed gRPC stubs are exactly what protoc generates now from the .proto file,
and they import under the name that Serve's proxy and replicas pickle them by."""
from __future__ import annotations

import pickle
from pathlib import Path

import grpc_tools  # noqa: F401 -- grpcio-tools (the test extra): generate.py runs its protoc

from protos import generate


def test_committed_stubs_match_protoc(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    for proto in generate.PROTO_FILES:
        for path in generate.generated_files(proto):
            committed = generate.ROOT / path
            assert committed.is_file(), f"{path} is missing: run python protos/generate.py"
            assert committed.read_bytes() == (tmp_path / path).read_bytes(), (
                f"{path} is stale: run python protos/generate.py and commit the result"
            )


def test_stub_modules_are_named_by_their_import_path() -> None:
    from protos.kvserve.v1 import kvserve_pb2, kvserve_pb2_grpc

    assert kvserve_pb2.GenerateRequest.__module__ == "protos.kvserve.v1.kvserve_pb2"
    assert hasattr(kvserve_pb2_grpc, "add_KVServeServicer_to_server")
    # Serve pickles request messages between its proxy and the replicas.
    request = kvserve_pb2.GenerateRequest(prompt="hi", max_tokens=3, stop=["\n"])
    assert pickle.loads(pickle.dumps(request)) == request


def test_every_field_and_rpc_is_commented() -> None:
    """Each field, enum value and rpc of the .proto carries a comment (the API's docs)."""
    from protos.kvserve.v1 import kvserve_pb2

    text = (generate.ROOT / generate.PROTO_FILES[0]).read_text().splitlines()
    file = kvserve_pb2.DESCRIPTOR
    names: list[str] = []
    for message in file.message_types_by_name.values():
        names += [f.name for f in message.fields]
        for enum in message.enum_types:
            names += [v.name for v in enum.values]
    for enum in file.enum_types_by_name.values():
        names += [v.name for v in enum.values]
    names += [m.name for m in file.services_by_name["KVServe"].methods]
    for name in set(names):
        for i, line in enumerate(text):
            stripped = line.strip()
            declares = stripped.startswith(f"rpc {name}(") or (
                f" {name} = " in f" {stripped}" and not stripped.startswith("//")
            )
            if declares:
                assert "//" in line or text[i - 1].strip().startswith("//"), f"{name} has no comment"
