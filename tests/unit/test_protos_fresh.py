"""The committed stubs in specdec/v1 are exactly what scripts/gen_protos.py generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    protos = _generator().generate(tmp_path)
    assert protos, "no .proto files found"
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "specdec" / "v1").iterdir())
    committed = sorted(
        p.relative_to(ROOT) for p in (ROOT / "specdec" / "v1").iterdir()
        if p.suffix in (".py", ".pyi") and p.name != "__init__.py"
    )
    assert fresh == committed
    for relative in fresh:
        assert (tmp_path / relative).read_bytes() == (ROOT / relative).read_bytes(), (
            f"{relative} is stale: run python scripts/gen_protos.py"
        )


def test_every_proto_declares_package_matching_its_folder():
    for proto in (ROOT / "protos" / "specdec" / "v1").glob("*.proto"):
        assert "package specdec.v1;" in proto.read_text(), proto
