"""Security, with real processes started through the CLI: TLS on every channel, mutual
TLS between the orchestrator and the model services, a bearer token on the public API.

Certificates are made here with the openssl command line: a CA; the model services' certificate,
which names only `specdec-replica.test` (as a certificate for a Kubernetes Service would, while the
orchestrator dials addresses), so the orchestrator needs --upstream-tls-server-name; the
orchestrator's public certificate (127.0.0.1); a client certificate for the orchestrator and one
for the tests; and a rogue CA with a client certificate of its own."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.auth import TOKEN_ENV, bearer_metadata, load_token
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

from tests.reliability.reliability_support import CALL_SECONDS, Service, start_all, stop_all

REPLICA_NAME = "specdec-replica.test"
TOKEN = "correct-horse-battery-staple"
PROMPT = [5, 9, 13, 2, 8]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)


def _leaf(directory: Path, name: str, ca: str, san: str, usage: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    (directory / f"{name}.ext").write_text(
        f"basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n" + (f"subjectAltName={san}\n" if san else ""))
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is needed to make test certificates")
    directory = tmp_path_factory.mktemp("pki")
    _ca(directory, "ca")
    _ca(directory, "rogue-ca")
    _leaf(directory, "replica", "ca", f"DNS:{REPLICA_NAME}", "serverAuth")
    _leaf(directory, "public", "ca", "IP:127.0.0.1,DNS:localhost", "serverAuth")
    _leaf(directory, "orchestrator-client", "ca", "", "clientAuth")
    _leaf(directory, "client", "ca", "", "clientAuth")
    _leaf(directory, "rogue-client", "rogue-ca", "", "clientAuth")
    (directory / "token").write_text(TOKEN + "\n")  # a trailing newline, as in a mounted Secret
    return directory


@pytest.fixture(scope="module")
def cluster(tiny_pair, pki):
    mtls = ["--dtype", "float64", "--tls-cert", str(pki / "replica.crt"), "--tls-key", str(pki / "replica.key"),
            "--tls-ca", str(pki / "ca.crt")]
    services = {
        "target": Service("target", ["--model", str(tiny_pair.target_dir), *mtls]),
        "draft": Service("draft", ["--model", str(tiny_pair.draft_dir), *mtls]),
    }
    try:
        start_all(services.values())
        services["orchestrator"] = Service("orchestrator", [
            "--target", services["target"].address, "--draft", services["draft"].address,
            # Public API: TLS (no client certificate) and a bearer token.
            "--tls-cert", str(pki / "public.crt"), "--tls-key", str(pki / "public.key"),
            "--auth-token-file", str(pki / "token"), "--health-port", "0",
            # To the replicas: mutual TLS with its own client certificate.
            "--upstream-tls-cert", str(pki / "orchestrator-client.crt"),
            "--upstream-tls-key", str(pki / "orchestrator-client.key"),
            "--upstream-tls-ca", str(pki / "ca.crt"), "--upstream-tls-server-name", REPLICA_NAME,
            "--num-speculative-tokens", "3", "--startup-timeout", "120",
        ]).start()
        yield services
    finally:
        codes = stop_all(reversed(list(services.values())))
        assert all(code == 0 for code in codes.values()), codes


def _credentials(pki: Path, client: str | None, trust: str = "ca") -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(pki / f"{trust}.crt").read_bytes(),
        private_key=(pki / f"{client}.key").read_bytes() if client else None,
        certificate_chain=(pki / f"{client}.crt").read_bytes() if client else None,
    )


def _replica_channel(service: Service, pki: Path, client: str | None) -> grpc.Channel:
    return grpc.secure_channel(service.address, _credentials(pki, client),
                               options=[("grpc.ssl_target_name_override", REPLICA_NAME)])


def _info(service: Service, channel: grpc.Channel) -> common_pb2.InfoResponse:
    kind = target_pb2_grpc.TargetServiceStub if service.role == "target" else draft_pb2_grpc.DraftServiceStub
    return kind(channel).Info(common_pb2.InfoRequest(), timeout=CALL_SECONDS)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def _generate(channel: grpc.Channel, metadata=None) -> tuple[list[int], pb.GenerateResponse]:
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=20,
                                 speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                                                  num_speculative_tokens=3))
    tokens, last = [], None
    for last in orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=CALL_SECONDS,
                                                                         metadata=metadata):
        tokens.extend(last.token_ids)
    assert last is not None
    return tokens, last


@pytest.mark.parametrize("role", ["target", "draft", "orchestrator"])
def test_a_plaintext_client_against_a_tls_server_fails(cluster, role):
    service = cluster[role]
    with grpc.insecure_channel(service.address) as channel:
        if role == "orchestrator":
            error = _refused(lambda: _generate(channel, bearer_metadata(TOKEN)))
        else:
            error = _refused(lambda: _info(service, channel))
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_model_service_refuses_a_client_without_a_valid_certificate(cluster, pki, role):
    service = cluster[role]
    for client in (None, "rogue-client"):  # no certificate; one from another CA
        with _replica_channel(service, pki, client) as channel:
            error = _refused(lambda: _info(service, channel))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, (client, error)
    with _replica_channel(service, pki, "client") as channel:  # a certificate signed by the CA
        assert _info(service, channel).role == role


def test_a_client_that_does_not_trust_the_server_certificate_refuses_it(cluster, pki):
    credentials = _credentials(pki, "client", trust="rogue-ca")
    with grpc.secure_channel(cluster["target"].address, credentials,
                             options=[("grpc.ssl_target_name_override", REPLICA_NAME)]) as channel:
        assert _refused(lambda: _info(cluster["target"], channel)).code() == grpc.StatusCode.UNAVAILABLE


def test_the_orchestrator_works_end_to_end_over_tls_and_mutual_tls(cluster, pki, reference_target):
    with grpc.secure_channel(cluster["orchestrator"].address, _credentials(pki, None)) as channel:
        tokens, last = _generate(channel, bearer_metadata(TOKEN))
    with torch.no_grad():
        output = reference_target.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                                           attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    assert tokens == output[0, len(PROMPT):].tolist()
    assert last.stats.drafted_tokens > 0  # the draft answered too, over its own mutual TLS


@pytest.mark.parametrize("metadata", [None, bearer_metadata("wrong-token"), (("authorization", TOKEN),),
                                      bearer_metadata(TOKEN + "x")],
                         ids=["missing", "wrong", "no-scheme", "longer"])
def test_the_public_api_refuses_a_missing_or_wrong_token(cluster, pki, metadata):
    with grpc.secure_channel(cluster["orchestrator"].address, _credentials(pki, None)) as channel:
        error = _refused(lambda: _generate(channel, metadata))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in error.details(), error
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        error = _refused(lambda: stub.Pools(pb.PoolsRequest(), timeout=CALL_SECONDS, metadata=metadata))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Pools(pb.PoolsRequest(), timeout=CALL_SECONDS, metadata=bearer_metadata(TOKEN)).pools


def test_health_stays_reachable_without_a_token(cluster, pki):
    orchestrator = cluster["orchestrator"]
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.secure_channel(orchestrator.address, _credentials(pki, None)) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=CALL_SECONDS)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"127.0.0.1:{orchestrator.health_port}") as channel:  # the probes' port
        response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=CALL_SECONDS)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_the_token_comes_from_a_file_or_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(" from-file\n")
    assert load_token(token_file, {TOKEN_ENV: "from-env"}) == "from-file"  # the flag wins
    assert load_token(None, {TOKEN_ENV: "from-env\n"}) == "from-env"
    assert load_token(None, {}) is None  # no token: the API is open
    token_file.write_text("\n")
    with pytest.raises(ValueError):
        load_token(token_file, {})  # an empty token would let anyone in
    with pytest.raises(ValueError):
        load_token(None, {TOKEN_ENV: ""})
