"""How long torch's idle OpenMP threads spin before they sleep (GNU libgomp, which torch's Linux
CPU builds use).

Between two parallel regions a team's idle threads busy-wait for the next one, by default for
GOMP_SPINCOUNT = 300,000 spins (several milliseconds), while the process has no more OpenMP
threads than CPUs. Inside a forward pass that is what keeps small ops cheap (no futex wake-up per
op). After a pass it burns CPUs someone else could use: where a draft and a target share cores,
each service's team spins on through the other's next pass, and a draft pass that follows a target
pass ran at twice its cost. Bounded at 50,000 spins (about a millisecond, still far longer than the
gaps between one pass's ops), speculation at one stream on two shared cores went from 1.0-1.1x to
1.2-1.3x over speculation off, and a service alone on its cores passed no slower.

libgomp reads the variable once, when it is loaded (with torch), so `specdec` sets it before any
command imports torch; a value in the environment is kept. Plain Python: no torch here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_COUNT_VARIABLE = "GOMP_SPINCOUNT"
DEFAULT_SPIN_COUNT = 50_000


def bound_idle_spin(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Sets GOMP_SPINCOUNT to DEFAULT_SPIN_COUNT unless the environment has one. True if torch
    (and with it libgomp) was not loaded yet in this process, so that the value applies here too;
    processes started from this one inherit it either way."""
    environ.setdefault(SPIN_COUNT_VARIABLE, str(DEFAULT_SPIN_COUNT))
    return "torch" not in sys.modules
