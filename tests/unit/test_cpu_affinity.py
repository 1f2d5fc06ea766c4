"""`--cpus` of `specdec serve` (specdec/cpu_affinity.py): CPU lists as taskset writes them, a clear
error for a malformed list or CPUs this process may not use (naming those it may), and pinning
that reaches every thread of the process, those started before it included. Pinning runs in a
child process, never in the test process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from specdec.cpu_affinity import check_available, format_cpu_list, parse_cpu_list

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")


@pytest.mark.parametrize("text, cpus", [
    ("0", {0}),
    ("1", {1}),
    ("0,1", {0, 1}),
    ("0-3", {0, 1, 2, 3}),
    ("0-1,4,6-7", {0, 1, 4, 6, 7}),
    (" 2 , 0 ", {0, 2}),
    ("3-3", {3}),
    ("1,1,0-1", {0, 1}),
    ("12", {12}),
])
def test_a_cpu_list_is_numbers_and_ranges(text, cpus):
    assert parse_cpu_list(text) == frozenset(cpus)


@pytest.mark.parametrize("text, says", [
    ("", "expected CPU numbers"),
    ("  ", "expected CPU numbers"),
    ("0,", "expected CPU numbers"),
    (",1", "expected CPU numbers"),
    ("a", "'a' is not a CPU number"),
    ("-1", "'-1' is not a CPU number"),
    ("0-", "'0-' is not a CPU number"),
    ("1.5", "'1.5' is not a CPU number"),
    ("0-2-4", "'0-2-4' is not a CPU number"),
    ("3-1", "the range '3-1' runs backwards"),
])
def test_a_malformed_list_says_what_is_wrong(text, says):
    with pytest.raises(ValueError, match="^--cpus ") as raised:
        parse_cpu_list(text)
    assert says in str(raised.value)


@pytest.mark.parametrize("cpus, text", [
    ({0}, "0"), ({0, 1}, "0-1"), ({0, 1, 2, 5}, "0-2,5"), ({1, 3, 4, 5, 9}, "1,3-5,9"), (set(), ""),
])
def test_format_is_the_inverse_of_parse(cpus, text):
    assert format_cpu_list(cpus) == text
    if cpus:
        assert parse_cpu_list(text) == frozenset(cpus)


def test_unavailable_cpus_are_named_with_those_available():
    with pytest.raises(ValueError) as raised:
        check_available(frozenset({0, 5, 6}), frozenset({0, 1, 2, 3}))
    assert str(raised.value) == "--cpus: CPUs 5-6 not available to this process; available: 0-3"
    with pytest.raises(ValueError, match="^--cpus: CPU 7 not available to this process; available: 0-1$"):
        check_available(frozenset({7}), frozenset({0, 1}))
    check_available(frozenset({1}), frozenset({0, 1}))  # a subset: fine


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, check=False)


@linux_only
def test_pinning_reaches_threads_started_before_and_after():
    cpu = min(os.sched_getaffinity(0))
    result = _child(f"""
        import os, threading
        from specdec.cpu_affinity import pin_to_cpus
        started = threading.Event(); stop = threading.Event(); tids = []
        def worker():
            tids.append(threading.get_native_id()); started.set(); stop.wait()
        early = threading.Thread(target=worker); early.start(); started.wait()
        assert pin_to_cpus("{cpu}") == {{{cpu}}}
        started.clear(); late = threading.Thread(target=worker); late.start(); started.wait()
        masks = [os.sched_getaffinity(t) for t in [0, *tids]]
        stop.set(); early.join(); late.join()
        print(masks)
        assert all(mask == {{{cpu}}} for mask in masks), masks
    """)
    assert result.returncode == 0, result.stderr


@linux_only
def test_pinning_to_unavailable_cpus_fails_and_leaves_the_mask_alone():
    result = _child("""
        import os
        from specdec.cpu_affinity import pin_to_cpus
        before = os.sched_getaffinity(0)
        missing = max(before) + 1000
        try:
            pin_to_cpus(f"0,{missing}")
        except ValueError as error:
            print(error)
        else:
            raise SystemExit("no error")
        assert os.sched_getaffinity(0) == before
    """)
    assert result.returncode == 0, result.stderr
    available = format_cpu_list(os.sched_getaffinity(0))
    assert result.stdout.strip().endswith(f"not available to this process; available: {available}")
