"""The committed generated protobuf code matches kvstore/protos/kvstore.proto (no drift)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["kvstore_pb2.py", "kvstore_pb2_grpc.py", "kvstore_pb2.pyi"]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", GENERATED)
def test_generated_code_matches_proto(tmp_path: Path, name: str) -> None:
    _load_generator().generate(tmp_path)
    fresh = (tmp_path / "kvstore" / "protos" / name).read_text()
    committed = (ROOT / "kvstore" / "protos" / name).read_text()
    assert fresh == committed, (
        f"kvstore/protos/{name} is stale: run `python tools/gen_protos.py` and commit the result"
    )


def test_generated_code_imports_package_qualified() -> None:
    from kvstore.protos import kvstore_pb2, kvstore_pb2_grpc

    assert kvstore_pb2.DESCRIPTOR.package == "kvstore.v1"
    assert hasattr(kvstore_pb2_grpc, "StoreNodeServicer")
