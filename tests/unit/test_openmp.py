"""The `specdec` command bounds OpenMP's idle spinning (specdec/openmp.py) before torch, and with it
libgomp, is loaded: libgomp reads GOMP_SPINCOUNT once, at load, so a value set after would do
nothing. A user's own value is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from specdec.openmp import DEFAULT_SPIN_COUNT, SPIN_COUNT_VARIABLE, bound_idle_spin

# Runs the real command's entry point (`specdec serve --help` imports torch to add its flags) with
# an import hook that records GOMP_SPINCOUNT at the moment torch's import starts.
_PROBE = """
import importlib.abc, json, os, sys
seen = {}
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "at_torch_import" not in seen:
            seen["at_torch_import"] = os.environ.get("GOMP_SPINCOUNT")
        return None
sys.meta_path.insert(0, Probe())
from specdec_cli.main import main
try:
    main(["serve", "--help"])
except SystemExit:
    pass
print(json.dumps({"torch_loaded": "torch" in sys.modules, **seen}))
"""


def _probe(environ: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE], env=environ, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_command_sets_the_spin_count_before_torch_loads():
    environ = {k: v for k, v in os.environ.items() if k != SPIN_COUNT_VARIABLE}
    seen = _probe(environ)
    assert seen["torch_loaded"]
    assert seen["at_torch_import"] == str(DEFAULT_SPIN_COUNT)


def test_a_spin_count_in_the_environment_is_kept():
    environ = {**os.environ, SPIN_COUNT_VARIABLE: "1234"}
    assert _probe(environ)["at_torch_import"] == "1234"


def test_bound_idle_spin_fills_only_a_missing_value():
    empty: dict[str, str] = {}
    bound_idle_spin(empty)
    assert empty == {SPIN_COUNT_VARIABLE: str(DEFAULT_SPIN_COUNT)}
    given = {SPIN_COUNT_VARIABLE: "0"}
    bound_idle_spin(given)
    assert given == {SPIN_COUNT_VARIABLE: "0"}


def test_bound_idle_spin_says_whether_torch_was_already_loaded():
    import torch  # noqa: F401  (this test process has it; the value then applies to children only)

    assert bound_idle_spin({}) is False
