"""`specdec pools` and `specdec generate` against a real orchestrator whose API is served over TLS
(the --tls-ca, --tls-cert, --tls-key and --tls-server-name client flags both commands share)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import orchestrator.server
from orchestrator.pool import PoolConfig
from orchestrator.service import OrchestratorConfig
from specdec.rpc.server import ServerConfig, TlsConfig
from specdec_cli.main import main

SERVER_NAME = "orchestrator.test"  # the certificate names this, not 127.0.0.1


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def make_pki(directory: Path) -> Path:
    """ca.crt, and server.crt / server.key for SERVER_NAME signed by it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specdec test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
              .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
              .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "server.crt").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_key(key, directory / "server.key")
    return directory


@pytest.fixture(scope="module")
def tls_orchestrator(loop_thread, stack, tmp_path_factory):
    """An orchestrator over the session's target and draft, its API on TLS."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    config = OrchestratorConfig(draft=stack.draft_address, target=stack.target_address,
                                pool=PoolConfig(refresh_seconds=0.5), startup_timeout_seconds=60)
    tls = TlsConfig(cert_file=pki / "server.crt", key_file=pki / "server.key")
    running, service = loop_thread.run(orchestrator.server.start(config, ServerConfig(port=0, tls=tls)))
    try:
        yield f"127.0.0.1:{running.port}", pki
    finally:
        loop_thread.run(service.close())
        loop_thread.run(running.stop())


def test_pools_over_tls(tls_orchestrator, capsys):
    address, pki = tls_orchestrator
    assert main(["pools", "--orchestrator", address, "--tls-ca", str(pki / "ca.crt"),
                 "--tls-server-name", SERVER_NAME]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("target pool (127.0.0.1:") or lines[1].startswith("target pool (127.0.0.1:")
    assert any(line.split()[:1] == ["draft"] for line in lines[3:])


def test_generate_over_tls(tls_orchestrator, capsys):
    address, pki = tls_orchestrator
    assert main(["generate", "--orchestrator", address, "--tls-ca", str(pki / "ca.crt"),
                 "--tls-server-name", SERVER_NAME, "--prompt-ids", "5,9,13", "--max-new-tokens", "4",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 1


@pytest.mark.parametrize("flags", [[], ["--tls-ca", "CA"]], ids=["plaintext", "wrong-server-name"])
def test_pools_is_refused_without_the_right_tls(tls_orchestrator, flags, capsys):
    address, pki = tls_orchestrator
    flags = [str(pki / "ca.crt") if flag == "CA" else flag for flag in flags]
    assert main(["pools", "--orchestrator", address, "--timeout", "5", *flags]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_client_tls_flags_without_a_ca_are_a_usage_error(tmp_path, capsys):
    assert main(["pools", "--tls-cert", str(tmp_path / "c.crt"), "--tls-key", str(tmp_path / "c.key")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "specdec: --tls-cert, --tls-key and --tls-server-name need --tls-ca"]
