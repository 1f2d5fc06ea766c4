"""Starting services as separate processes and waiting for their READY line (up, demo, tests)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec_cli.flags import UsageError

READY = re.compile(r"^READY (\w+) (\S+):(\d+)")
READY_METRICS = re.compile(r" metrics=(\d+)")


class ServiceDidNotStart(UsageError):
    """A `specdec serve` process exited, or ran out of time, before its READY line. The message
    is one line ending with the last line it printed; `output` has the rest."""

    def __init__(self, role: str, returncode: int | None, output: str) -> None:
        last = next((line for line in reversed(output.splitlines()) if line.strip()), "")
        how = f"exited with {returncode}" if returncode is not None else "timed out"
        super().__init__(f"the {role} service did not start ({how}): {last.strip()}")
        self.output = output
        self.add_note(f"its output:\n{output[-4000:]}")


@dataclass
class ServiceProcess:
    role: str
    process: subprocess.Popen
    address: str = ""
    lines: deque = field(default_factory=lambda: deque(maxlen=200))
    metrics_port: int | None = None  # from the READY line, when started with --metrics-port

    @property
    def metrics_url(self) -> str | None:
        """http://HOST:PORT/metrics of its Prometheus endpoint, if it serves one."""
        if self.metrics_port is None:
            return None
        return f"http://{self.address.rsplit(':', 1)[0]}:{self.metrics_port}/metrics"

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the service drains), then SIGKILL after timeout."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, for fault tests."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def output(self) -> str:
        return "".join(self.lines)


def specdec_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "specdec_cli.main", *args]


def start_service(
    role: str, args: list[str], timeout: float = 600.0, echo: bool = False, env: dict | None = None,
    on_spawn: Callable[[ServiceProcess], None] | None = None,
) -> ServiceProcess:
    """Runs `specdec serve ROLE ARGS` and returns once it printed READY (with its address).
    on_spawn(service) is called as soon as the process exists, before it is ready (to stop it
    if the start is abandoned). Raises ServiceDidNotStart."""
    command = specdec_command("serve", role, *args)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, **(env or {})},
    )
    service = ServiceProcess(role, process)
    if on_spawn is not None:
        on_spawn(service)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            service.lines.append(line)
            if echo:
                sys.stderr.write(f"[{role}] {line}")
            match = READY.match(line)
            if match and not ready.is_set():
                service.address = f"{match.group(2)}:{match.group(3)}"
                metrics = READY_METRICS.search(line)
                service.metrics_port = int(metrics.group(1)) if metrics else None
                ready.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        if process.poll() is not None or time.monotonic() > deadline:
            returncode = process.poll()
            service.kill()
            reader.join(10)  # its last lines say why
            raise ServiceDidNotStart(role, returncode, service.output())
    return service
