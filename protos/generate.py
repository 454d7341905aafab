"""Regenerates the Python stubs of kvserve's .proto files (never edit the stubs by hand).

    python protos/generate.py            # rewrite protos/kvserve/v1/kvserve_pb2*.py(i)
    python protos/generate.py --check    # exit 1 when the committed stubs are stale

protoc runs with the repository root as its only include path, so the generated modules
import each other as `protos.kvserve.v1.kvserve_pb2`: their module names match their
import paths. Serve's gRPC proxy and the replicas pickle request messages by class
reference; stubs generated with `-I protos` (module `kvserve.v1.kvserve_pb2`) fail to
deploy with "cannot pickle ... Descriptor".
"""
from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("protos/kvserve/v1/kvserve.proto",)


def generated_files(proto: str) -> list[str]:
    """The stub paths (relative to the root) protoc writes for one .proto file."""
    stem = proto.removesuffix(".proto")
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc (grpcio-tools) on every .proto file, writing the stubs under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in PROTO_FILES:
        command = [
            sys.executable, "-m", "grpc_tools.protoc",
            "-I", ".",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            proto,
        ]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"protoc failed on {proto}:\n{result.stderr}")
    return [out_dir / path for proto in PROTO_FILES for path in generated_files(proto)]


def stale_files() -> list[str]:
    """Stubs under the root that differ from what protoc generates now (or are missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for proto in PROTO_FILES:
            for path in generated_files(proto):
                committed, fresh = ROOT / path, Path(tmp) / path
                if not committed.is_file() or not filecmp.cmp(committed, fresh, shallow=False):
                    stale.append(path)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale: {path} (run: python protos/generate.py)", file=sys.stderr)
        return 1 if stale else 0
    for path in generate(ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
