"""The one starter of services as separate local processes (`specdec up`, `specdec demo`, the
benchmarks): `specdec serve ...` processes started concurrently and stopped together, those still
starting included, so an interrupted or failed start leaves no process behind."""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from specdec.rpc.server import check_port_free
from specdec_cli.client import DEFAULT_PORTS
from specdec_cli.processes import ServiceProcess, start_service

DEFAULT_HTTP_PORT = 8000  # `specdec up`'s OpenAI-compatible HTTP API

# (role, the arguments of `specdec serve ROLE`, environment additions or None)
ServiceCommand = tuple[str, list[str], dict[str, str] | None]
Result = TypeVar("Result")


def start_services(stack: ExitStack, commands: Sequence[ServiceCommand], timeout: float = 900.0,
                   echo: bool = False) -> list[ServiceProcess]:
    """`specdec serve ROLE ARGS` for each command, started concurrently; returns once each printed
    READY, in the order given. Leaving `stack` stops every process these commands started
    (SIGTERM to all at once, then each is waited for), including one still starting. Raises
    the first failure (ServiceDidNotStart) once every start has finished."""
    spawned: list[ServiceProcess] = []
    lock = threading.Lock()
    stopping = False

    def on_spawn(service: ServiceProcess) -> None:
        with lock:
            if not stopping:
                spawned.append(service)
                return
        service.kill()  # spawned after the stack was left (an interrupted start)

    def stop_all() -> None:
        nonlocal stopping
        with lock:
            stopping = True
        stop_services(spawned)

    stack.callback(stop_all)

    def start(role: str, args: list[str], env: dict[str, str] | None) -> ServiceProcess:
        return start_service(role, args, timeout=timeout, echo=echo, env=env, on_spawn=on_spawn)

    return run_concurrently([partial(start, *command) for command in commands])


def stop_services(services: Sequence[ServiceProcess]) -> None:
    """SIGTERM to all at once (each drains on its own), then wait for all."""
    run_concurrently([service.stop for service in services])


def run_concurrently(calls: Sequence[Callable[[], Result]]) -> list[Result]:
    """Each call in a thread of its own, all at once; once all have ended, their results in the
    order given, or the first failure raised. Daemon threads: a caller interrupted by Ctrl-C
    leaves without waiting for them."""
    results: list[Result | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as error:  # raised below, once every call has ended
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]


def stop_on_signals() -> None:
    """From now on the first SIGINT or SIGTERM raises KeyboardInterrupt in the main thread, at
    any point (a start included), and later ones are ignored so the stop that follows runs to its
    end. Installed explicitly: a background job of a non-interactive shell starts with SIGINT
    ignored, and Python then raises no KeyboardInterrupt on Ctrl-C."""

    def interrupt(number: int, frame: object) -> None:
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt

    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, interrupt)


@dataclass(frozen=True)
class StackConfig:
    """A local stack: the two model services on free ports and an orchestrator in front of them.
    None leaves a setting to `specdec serve` (the defaults of its config dataclasses)."""

    target: str = "default"
    draft: str = "default"
    device: str | None = None
    dtype: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORTS["orchestrator"]  # the orchestrator's; the model services take free ports
    speculation: str | None = None
    num_speculative_tokens: int | None = None
    max_num_speculative_tokens: int | None = None
    pipeline: str | None = None
    pipeline_fanout: int | None = None
    # The orchestrator's --draft-method. A local stack serves one user, so it takes the lookups'
    # gains by default; `specdec serve orchestrator` keeps them opt-in (their index of a session's
    # tokens costs the orchestrator memory per concurrent session). Pipelining needs "model".
    draft_method: str = "hybrid"
    echo: bool = True  # copy the services' output to stderr, each line prefixed with its role
    threads: int | None = None  # torch threads of each model service
    packed_rows: str | None = None  # each model service's --packed-rows (auto, off or N,N)
    http_port: int | None = None  # the orchestrator's OpenAI-compatible HTTP API; None: none
    # The two model services share this machine's cores: their forward passes take turns
    # (`specdec serve --pass-lock`, specdec/pass_lock.py) rather than slow each other down.
    pass_lock: bool = True
    draft_head: str | None = None  # the target's --draft-head (None: its default, auto)


def _flags(**values: object) -> list[str]:
    """--name value for each value that is set."""
    return [text for name, value in values.items() if value is not None
            for text in (f"--{name.replace('_', '-')}", str(value))]


def orchestrator_flags(config: StackConfig) -> list[str]:
    """The orchestrator's flags beyond its --draft and --target."""
    return _flags(host=config.host, port=config.port, metrics_port=0, speculation=config.speculation,
                  num_speculative_tokens=config.num_speculative_tokens,
                  max_num_speculative_tokens=config.max_num_speculative_tokens,
                  pipeline=config.pipeline, pipeline_fanout=config.pipeline_fanout,
                  draft_method=config.draft_method, http_port=config.http_port)


@contextmanager
def local_stack(config: StackConfig) -> Iterator[dict[str, ServiceProcess]]:
    """Starts target and draft (concurrently), then the orchestrator; stops all on exit."""
    check_port_free(config.host, config.port)  # before minutes of loading models
    if config.http_port is not None:
        check_port_free(config.host, config.http_port)
    with ExitStack() as stack:
        pass_lock = None
        if config.pass_lock:
            pass_lock = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specdec-"))) / "passes.lock"
        common = _flags(device=config.device, dtype=config.dtype, host=config.host, port=0,
                        threads=config.threads, packed_rows=config.packed_rows, metrics_port=0,
                        pass_lock=pass_lock)
        target, draft = start_services(stack, [
            ("target", ["--model", config.target, *common, *_flags(draft_head=config.draft_head)], None),
            ("draft", ["--model", config.draft, *common], None),
        ], timeout=600.0, echo=config.echo)
        (orchestrator,) = start_services(stack, [("orchestrator", [
            "--draft", draft.address, "--target", target.address, *orchestrator_flags(config),
        ], None)], timeout=600.0, echo=config.echo)
        yield {"target": target, "draft": draft, "orchestrator": orchestrator}


def prepare_default_models(pair) -> None:
    """Dequantises and caches the default target once, here, with a progress bar, so the two
    services do not both do it at start. pair: anything with .target and .draft."""
    if "default" in (pair.target, pair.draft):
        from specdec.default_model import resolve_default_target

        resolve_default_target(progress=True)
