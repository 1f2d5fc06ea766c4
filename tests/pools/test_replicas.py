"""Pools of replicas as separate processes started through the CLI (docs/architecture.md, "Pools
and discovery").

Three target and two draft replicas (tiny float64 models). Replicas of one pool listen on the same
port at different loopback addresses (127.0.0.11, .12, ...), as pods of a Service do, so the same
processes serve an orchestrator given static lists (in this process), an orchestrator process that
watches EndpointSlices (k8s://, through a local server that speaks that API, found by $KUBECONFIG),
and one that resolves DNS names (dns:///, in this process).

Mid-stream events are made deterministic by freezing every target replica (SIGSTOP): no stream can
finish while they are stopped, so which replica holds which sessions stays put while the test reads
the orchestrator's Pools and changes the world; then they continue (SIGCONT).

The last test kills a target replica; it stays last in this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from orchestrator.pool import PoolConfig
from orchestrator.server import start as start_orchestrator
from orchestrator.service import OrchestratorConfig
from specdec.rpc.server import ServerConfig
from specdec_cli.main import main as specdec_main
from specdec_cli.processes import ServiceProcess, start_service

from tests import tiny_models
from tests.pools.fake_kube_api import FakeKubeApi, endpoint, endpoint_slice, kubeconfig
from tests.pools.pool_support import References, info, pools, start_streams, usable
from tests.waiting import eventually

NAMESPACE = "specdec"
TARGET_HOSTS = ("127.0.0.11", "127.0.0.12", "127.0.0.13")
DRAFT_HOSTS = ("127.0.0.1", "127.0.0.21")  # 127.0.0.1: what `localhost` resolves to
SLICES = {"target": "target-x7k2p", "draft": "draft-q9w4z"}  # EndpointSlice names
SHORT, LONG = 24, 80  # max_new_tokens: a quick stream; one still running when the targets freeze


def _free_port(hosts: tuple[str, ...]) -> int:
    """A port free on every one of hosts (replicas of a pool share a port, as pods do)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no common free port on {hosts}")


@dataclass
class Cluster:
    target_port: int
    draft_port: int
    targets: dict[str, ServiceProcess]  # by address
    drafts: dict[str, ServiceProcess]
    static: str  # address of an orchestrator (in this process) with static lists a,b,c and d,e
    kube: ServiceProcess  # orchestrator process with --target k8s://... --draft k8s://...
    kube_api: FakeKubeApi

    def target_address(self, index: int) -> str:
        return f"{TARGET_HOSTS[index]}:{self.target_port}"

    @staticmethod
    def replica_id(address: str) -> str:
        host = address.rsplit(":", 1)[0]
        role, hosts = ("target", TARGET_HOSTS) if host in TARGET_HOSTS else ("draft", DRAFT_HOSTS)
        return f"{role}-{hosts.index(host) + 1}"

    def set_slice(self, role: str, ready: list[str], draining: list[str] = ()) -> None:
        """The role's Service has one EndpointSlice: ready endpoints, and serving-but-terminating ones."""
        endpoints = [endpoint(a.rsplit(":", 1)[0]) for a in ready]
        endpoints += [endpoint(a.rsplit(":", 1)[0], ready=False, serving=True, terminating=True) for a in draining]
        port = self.target_port if role == "target" else self.draft_port
        self.kube_api.apply(endpoint_slice(NAMESPACE, SLICES[role], role, endpoints, port))


@contextlib.contextmanager
def frozen(processes):
    """SIGSTOP: every call to these replicas waits; SIGCONT on the way out."""
    stopped = [p for p in processes if p.process.poll() is None]
    for p in stopped:
        p.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for p in stopped:
            if p.process.poll() is None:
                p.process.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def cluster(tiny_pair, tmp_path_factory, loop_thread):
    target_port, draft_port = _free_port(TARGET_HOSTS), _free_port(DRAFT_HOSTS)
    kube_api = FakeKubeApi().start()
    kubeconfig_path = tmp_path_factory.mktemp("kube") / "config"
    kubeconfig_path.write_text(json.dumps(kubeconfig(kube_api.url)))
    targets = [f"{h}:{target_port}" for h in TARGET_HOSTS]
    drafts = [f"{h}:{draft_port}" for h in DRAFT_HOSTS]
    kube_api.apply(endpoint_slice(NAMESPACE, SLICES["target"], "target",
                                  [endpoint(h) for h in TARGET_HOSTS[:2]], target_port))
    kube_api.apply(endpoint_slice(NAMESPACE, SLICES["draft"], "draft", [endpoint(h) for h in DRAFT_HOSTS], draft_port))

    def replica(role: str, address: str) -> ServiceProcess:
        host, port = address.rsplit(":", 1)
        model = tiny_pair.target_dir if role == "target" else tiny_pair.draft_dir
        return start_service(role, ["--model", str(model), "--dtype", "float64", "--host", host, "--port", port,
                                    "--replica-id", Cluster.replica_id(address), "--grace-seconds", "2"],
                             timeout=300)

    def kube_orchestrator() -> ServiceProcess:
        env = {"KUBECONFIG": str(kubeconfig_path), "KUBERNETES_SERVICE_HOST": ""}  # not in a pod
        return start_service("orchestrator", [
            "--target", f"k8s://{NAMESPACE}/target:{target_port}", "--draft", f"k8s://{NAMESPACE}/draft:{draft_port}",
            "--port", "0", "--startup-timeout", "300", "--grace-seconds", "2"], timeout=300, env=env)

    def static_orchestrator():
        config = OrchestratorConfig(draft=",".join(drafts), target=",".join(targets), startup_timeout_seconds=300,
                                    pool=PoolConfig(refresh_seconds=0.5))
        return loop_thread.run(start_orchestrator(config, ServerConfig(port=0)))

    started: list[ServiceProcess] = []
    static = None
    with ThreadPoolExecutor(8) as executor:  # everything starts at once; orchestrators wait for pools
        futures = [executor.submit(replica, "target", a) for a in targets]
        futures += [executor.submit(replica, "draft", a) for a in drafts]
        futures.append(executor.submit(kube_orchestrator))
        static_future = executor.submit(static_orchestrator)
        errors = []
        for future in futures:
            try:
                started.append(future.result())
            except Exception as error:  # stop the others before failing
                errors.append(error)
        try:
            static = static_future.result()
        except Exception as error:
            errors.append(error)
    try:
        if errors:
            raise errors[0]
        cluster = Cluster(target_port, draft_port, dict(zip(targets, started[:3])),
                          dict(zip(drafts, started[3:5])), f"127.0.0.1:{static[0].port}", started[5], kube_api)
        # An orchestrator serves once one replica per pool answers; the tests want them all.
        for address, expected_targets in ((cluster.static, targets), (cluster.kube.address, targets[:2])):
            eventually(lambda: usable(address, "target") == set(expected_targets)
                       and usable(address, "draft") == set(drafts), "every replica to answer")
        yield cluster
    finally:
        if static is not None:
            loop_thread.run(static[0].stop())
            loop_thread.run(static[1].close())
        with ThreadPoolExecutor(8) as executor:  # SIGTERM: each drains for its --grace-seconds
            list(executor.map(ServiceProcess.stop, started))
        kube_api.stop()


@pytest.fixture(scope="module")
def references(reference_target):
    return References(reference_target)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, len(tiny_models.VOCAB)) for _ in range(rng.randint(2, 12))] for _ in range(count)]


def _check_exact(prompts, results, references, max_new_tokens) -> None:
    for prompt, (tokens, stats) in zip(prompts, results):
        assert tokens == references(prompt, max_new_tokens), f"prompt {prompt}: {stats}"


def test_concurrent_sessions_spread_over_the_replicas(cluster, references):
    prompts = _prompts(6, seed=1)
    results = [s.result() for s in start_streams(cluster.static, prompts, SHORT)]
    _check_exact(prompts, results, references, SHORT)
    assert {stats.target_replica for _, stats in results} == {"target-1", "target-2", "target-3"}
    assert {stats.draft_replica for _, stats in results} == {"draft-1", "draft-2"}


def test_pools_command_lists_every_replica(cluster, capsys):
    assert specdec_main(["pools", "--orchestrator", cluster.static, "--json"]) == 0
    by_role = {pool["role"]: pool for pool in json.loads(capsys.readouterr().out)["pools"]}
    for role, processes in (("target", cluster.targets), ("draft", cluster.drafts)):
        replicas = {r["address"]: r for r in by_role[role]["replicas"]}
        assert set(replicas) == set(processes)
        assert by_role[role]["source"] == ",".join(processes)
        for address, replica in replicas.items():
            assert replica["replica_id"] == Cluster.replica_id(address)
            assert replica["healthy"] and replica["accepting"], replica
            assert replica["model_id"]

    assert specdec_main(["pools", "--orchestrator", cluster.kube.address]) == 0
    table = capsys.readouterr().out
    assert f"draft pool (k8s://{NAMESPACE}/draft:{cluster.draft_port}): 2 of 2 replicas" in table
    for address in cluster.drafts:
        assert address in table


def test_kubernetes_pool_follows_the_endpoint_slices(cluster, references):
    orchestrator = cluster.kube.address
    first, second, third = (cluster.target_address(i) for i in range(3))
    cluster.set_slice("draft", ready=list(cluster.drafts))
    cluster.set_slice("target", ready=[first, second])
    eventually(lambda: usable(orchestrator, "target") == {first, second}, "two ready targets")

    # A new endpoint (a scale-up) takes new sessions.
    cluster.set_slice("target", ready=[first, second, third])
    eventually(lambda: usable(orchestrator, "target") == {first, second, third}, "the third target")
    prompts = _prompts(6, seed=2)
    results = [s.result() for s in start_streams(orchestrator, prompts, SHORT)]
    _check_exact(prompts, results, references, SHORT)
    assert "target-3" in {stats.target_replica for _, stats in results}

    # Serving but terminating: still in the pool, takes no new session.
    cluster.set_slice("target", ready=[third], draining=[first, second])
    eventually(lambda: usable(orchestrator, "target") == {third}
               and set(pools(orchestrator)["target"]) == {first, second, third}, "two draining targets")
    prompts = _prompts(3, seed=3)
    results = [s.result() for s in start_streams(orchestrator, prompts, SHORT)]
    _check_exact(prompts, results, references, SHORT)
    assert {stats.target_replica for _, stats in results} == {"target-3"}


def test_a_draining_replica_keeps_its_sessions_and_a_removed_one_hands_them_over(cluster, references):
    orchestrator = cluster.kube.address
    targets, drafts = [cluster.target_address(i) for i in range(3)], list(cluster.drafts)
    cluster.set_slice("target", ready=targets)
    cluster.set_slice("draft", ready=drafts)
    eventually(lambda: usable(orchestrator, "target") == set(targets)
               and usable(orchestrator, "draft") == set(drafts), "every replica ready")
    prompts = _prompts(6, seed=4)
    streams = start_streams(orchestrator, prompts, LONG)
    # A stream opens its draft session with its first drafted round, which can come a moment
    # after its target session (with several sessions the speculation guard holds K = 0 until
    # its first test): wait for one before looking.
    eventually(lambda: any(r.active_sessions for r in pools(orchestrator)["draft"].values()),
               "a draft replica to hold a stream's session")
    with frozen([*cluster.targets.values(), *cluster.drafts.values()]):
        now = pools(orchestrator)
        sessions = {a: r.active_sessions for role in now.values() for a, r in role.items()}
        holding = sorted((a for a in targets if sessions[a] > 0), key=lambda a: -sessions[a])
        assert len(holding) >= 2, f"streams should be on several target replicas: {sessions}"
        draining, removed = holding[:2]
        removed_draft = max(drafts, key=sessions.get)
        assert sessions[removed_draft] >= 1, sessions
        cluster.set_slice("target", ready=[a for a in targets if a not in (draining, removed)], draining=[draining])
        cluster.set_slice("draft", ready=[a for a in drafts if a != removed_draft])

        def seen() -> bool:
            now = pools(orchestrator)
            return (removed not in now["target"] and not now["target"][draining].accepting
                    and removed_draft not in now["draft"])

        eventually(seen, "the orchestrator to see the new EndpointSlices")
    results = [s.result() for s in streams]
    _check_exact(prompts, results, references, LONG)

    # Draining: its sessions stay to the end. Removed: its sessions move (re-prefilled on the target
    # side; on the draft side the session goes on at K = 0, then on another draft).
    on_draining = [stats for _, stats in results if stats.target_replica == Cluster.replica_id(draining)]
    assert len(on_draining) == sessions[draining]
    assert all(stats.re_prefills == 0 for stats in on_draining), on_draining
    assert not any(stats.target_replica == Cluster.replica_id(removed) for _, stats in results)
    assert sum(stats.re_prefills >= 1 for _, stats in results) >= sessions[removed]
    assert sum(stats.draft_unavailable_rounds >= 1 for _, stats in results) >= sessions[removed_draft]
    # The removed replicas are still up: the orchestrator released the sessions it had there.
    eventually(lambda: info(removed, "target").live_sessions == 0, "the removed target to be released")
    eventually(lambda: info(removed_draft, "draft").live_sessions == 0, "the removed draft to be released")


def test_dns_pools_resolve_again_on_every_refresh(cluster, loop_thread, references, tmp_path):
    """An in-process orchestrator: targets from a DNS name whose answers the test controls, drafts
    from the real resolver (localhost)."""
    from orchestrator.service import OrchestratorService, PromptInput
    from specdec.sampling import SamplingParams

    first, second, third = (cluster.target_address(i) for i in range(3))
    answers = {"targets.pool.test": [TARGET_HOSTS[0], TARGET_HOSTS[1]]}

    async def resolver(host: str, port: int) -> list[str]:
        return list(answers[host])

    config = OrchestratorConfig(
        target=f"dns:///targets.pool.test:{cluster.target_port}", draft=f"dns:///localhost:{cluster.draft_port}",
        pool=PoolConfig(refresh_seconds=0.2),
        startup_timeout_seconds=120,
    )
    service = OrchestratorService(config)
    service.target_pool.source = dataclasses.replace(service.target_pool.source, resolver=resolver)

    async def generate(prompts):
        async def one(prompt):
            tokens, last = [], None
            chunks = service.generate(PromptInput(prompt_token_ids=tuple(prompt)), SHORT, SamplingParams())
            async for chunk in chunks:
                tokens.extend(chunk.token_ids)
                last = chunk
            return tokens, last.stats

        return await asyncio.gather(*(one(p) for p in prompts))

    async def snapshot():  # read on the loop that changes it
        return {a: (r.usable, r.refused) for a, r in service.target_pool.replicas.items()}

    def pool_state():
        return loop_thread.run(snapshot())

    odd_server = None
    loop_thread.run(service.start())
    try:
        draft = f"127.0.0.1:{cluster.draft_port}"
        assert service.draft_pool.replicas[draft].usable  # found through the system resolver
        prompts = _prompts(4, seed=5)
        results = loop_thread.run(generate(prompts))
        _check_exact(prompts, results, references, SHORT)
        assert {stats.target_replica for _, stats in results} == {"target-1", "target-2"}

        # A new address in the answer joins and takes new sessions.
        answers["targets.pool.test"].append(TARGET_HOSTS[2])
        eventually(lambda: pool_state().get(third, (False,))[0], "the third target to join")
        results = loop_thread.run(generate(_prompts(6, seed=6)))
        assert "target-3" in {stats.target_replica for _, stats in results}

        # A late joiner with another vocabulary is checked when it joins, and gets no session.
        odd_server = loop_thread.run(_start_mismatched_target(tmp_path, "127.0.0.14", cluster.target_port))
        answers["targets.pool.test"].append("127.0.0.14")
        odd = f"127.0.0.14:{cluster.target_port}"
        refusal = eventually(lambda: pool_state().get(odd, (False, ""))[1], "the mismatched target to be refused")
        assert "vocabulary" in refusal
        results = loop_thread.run(generate(_prompts(4, seed=7)))
        assert "target-odd" not in {stats.target_replica for _, stats in results}

        # An address that leaves the answer leaves the pool.
        answers["targets.pool.test"] = [TARGET_HOSTS[1], TARGET_HOSTS[2]]
        eventually(lambda: set(pool_state()) == {second, third}, "the first target to leave")
    finally:
        loop_thread.run(service.close())
        if odd_server is not None:
            loop_thread.run(odd_server.stop())


async def _start_mismatched_target(tmp_path, host: str, port: int):
    import target_service.server
    from specdec.models import ModelConfig, load_model
    from specdec.rpc.server import ServerConfig
    from specdec.serving import ServiceConfig

    model_dir = tiny_models.save(tiny_models.make_model(seed=3, vocab_size=len(tiny_models.VOCAB) + 11),
                                 tmp_path / "odd-target")
    loaded = await asyncio.to_thread(load_model, ModelConfig(str(model_dir), "target", dtype="float64"))
    server, _ = await target_service.server.start(loaded, ServiceConfig(replica_id="target-odd"),
                                                  ServerConfig(host=host, port=port))
    return server


def test_killing_a_target_mid_stream_keeps_every_stream_exact(cluster, references):
    """Kills a replica: keep this test last in the module."""
    orchestrator = cluster.static
    eventually(lambda: usable(orchestrator, "target") == set(cluster.targets), "three healthy targets")
    prompts = _prompts(6, seed=8)
    streams = start_streams(orchestrator, prompts, LONG)
    with frozen(cluster.targets.values()):
        sessions = {a: r.active_sessions for a, r in pools(orchestrator)["target"].items()}
        victim = max(sessions, key=sessions.get)
        assert sessions[victim] >= 1, sessions
        cluster.targets[victim].kill()  # SIGKILL: no drain, connections reset
    results = [s.result() for s in streams]
    _check_exact(prompts, results, references, LONG)
    assert not any(stats.target_replica == Cluster.replica_id(victim) for _, stats in results)
    assert sum(stats.re_prefills >= 1 for _, stats in results) >= sessions[victim]
    eventually(lambda: not pools(orchestrator)["target"][victim].healthy, "the victim to show unhealthy")
