"""Regenerate the Python stubs in specdec/v1 from protos/specdec/v1/*.proto.

Usage: python scripts/gen_protos.py [OUT_DIR]   (default: the repository root)
The stubs are committed; tests/unit/test_protos_fresh.py proves they match this script's output.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    protos = sorted((PROTO_ROOT / "specdec" / "v1").glob("*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    (out_dir / "specdec" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return protos


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
