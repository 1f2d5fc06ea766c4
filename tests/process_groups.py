"""A command that starts services (`specdec up`, `specdec demo`, a benchmark) as a process tree of
its own in a test: it leads a new process group (the services it starts join it), and once it
ends, fails or times out the whole group is killed, so a failed test leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from specdec_cli.processes import specdec_command

from tests.waiting import WAIT_SECONDS, eventually


class Running:
    """A started command and what it printed so far (stdout and stderr together)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float = WAIT_SECONDS) -> re.Match:
        """The first line that matches `pattern` (re.search), once it is printed."""
        def found() -> re.Match | None:
            match = next(filter(None, (re.search(pattern, line) for line in list(self.lines))), None)
            if match is None and self.process.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"exited with {self.process.returncode} before printing "
                                     f"{pattern!r}:\n{self.output()[-4000:]}")
            return match

        return eventually(found, f"a line matching {pattern!r}; so far:\n{self.output()[-4000:]}",
                          timeout=timeout)

    def wait(self, timeout: float = WAIT_SECONDS) -> int:
        """The exit status; fails the test if the command is still running after `timeout` (a
        liveness bound, not a timing assertion)."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:.0f} s:\n{self.output()[-4000:]}") from None
        self._reader.join(10)
        return code

    def group_alive(self) -> bool:
        """Whether any process of its group (its children included) still exists."""
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to every process left in the group `process` leads, then reap it."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_in_group(command: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen), the
    command leading a process group that is killed whole when it ends or times out."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **popen)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        kill_group(process)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@contextmanager
def run_specdec(*args: str, ignore_sigint: bool = False) -> Iterator[Running]:
    """`specdec ARGS` as the leader of a new process group. ignore_sigint: start it with SIGINT
    ignored, as a background job of a non-interactive shell does."""
    def ignore() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    process = subprocess.Popen(
        specdec_command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        bufsize=1, start_new_session=True, preexec_fn=ignore if ignore_sigint else None,
    )
    try:
        yield Running(process)
    finally:
        kill_group(process)
        if process.stdout is not None:
            process.stdout.close()
