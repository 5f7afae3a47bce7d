"""Regenerate kvstore/protos/kvstore_pb2*.py(i) from kvstore/protos/kvstore.proto, run from
anywhere.

Generated from the repository root so the code imports as
``from kvstore.protos import kvstore_pb2``.
``tests/test_protos.py`` runs :func:`generate` into a temporary directory and fails on drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = "kvstore/protos/kvstore.proto"


def generate(out_dir: Path, root: Path = ROOT) -> None:
    """Write the generated modules under ``out_dir/kvstore/protos/``."""
    (out_dir / "kvstore" / "protos").mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}", str(root / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
