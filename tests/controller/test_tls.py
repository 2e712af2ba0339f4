"""The controller over TLS with a certificate made in the test: the CLI and the worker's heartbeat
poster verify it through DEEPFLEET_CA_BUNDLE, and both refuse a certificate their bundle does not trust;
a real worker's job heartbeats over TLS to SUCCEEDED, and one given the wrong CA bundle posts nothing
(a clear CERTIFICATE_VERIFY_FAILED in its log, no fallback) while its training still completes."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import urllib.error
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepfleet.controller.cli import app
from tests.controller.conftest import ADMIN_TOKEN
from tests.controller.e2e_helpers import Controller, wait_phase
from tests.controller.jobspecs import FAKE_WORKER, job_document, tiny_gpt_job

ROOT = Path(__file__).resolve().parents[2]


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.mark.e2e
def test_cli_and_worker_verify_the_controllers_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deepfleet.worker.heartbeat import post_json

    cert, key = self_signed(tmp_path, "controller")
    wrong, _ = self_signed(tmp_path, "impostor")
    c = Controller(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "data", worker_command=FAKE_WORKER, tls=(cert, key))
    try:
        assert c.url.startswith("https://")
        doc = job_document("tls", args=["--steps", "1"], nodes=1)
        job = c.client.submit(json.dumps(doc), content_type="application/json")
        monkeypatch.setenv("DEEPFLEET_URL", c.url)
        monkeypatch.setenv("DEEPFLEET_API_TOKEN", ADMIN_TOKEN)
        runner = CliRunner()
        monkeypatch.setenv("DEEPFLEET_CA_BUNDLE", str(cert))
        result = runner.invoke(app, ["get", job["id"]])
        assert result.exit_code == 0 and job["id"] in result.output, result.output
        beat = json.dumps({"step": 1, "loss": 2.5}).encode()
        url = f"{c.url}/v1/jobs/{job['id']}/heartbeat"
        assert post_json(url, beat, token=ADMIN_TOKEN, timeout_s=10) == 200
        assert c.client.metrics(job["id"])[-1]["step"] == 1

        monkeypatch.setenv("DEEPFLEET_CA_BUNDLE", str(wrong))
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            post_json(url, beat, token=ADMIN_TOKEN, timeout_s=10)
        result = runner.invoke(app, ["get", job["id"]])
        assert result.exit_code != 0 and "cannot reach the controller" in result.output
    finally:
        c.client.close()  # an open keep-alive connection would hold up the server's graceful shutdown
        c.stop()


@pytest.mark.e2e
@pytest.mark.slow  # two real training jobs on one controller
def test_a_real_worker_heartbeats_over_tls_and_refuses_a_wrong_ca(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = self_signed(tmp_path, "controller")
    wrong, _ = self_signed(tmp_path, "impostor")
    data = tmp_path / "data"
    c = Controller(f"sqlite:///{tmp_path / 'db.sqlite'}", data, workdir=ROOT, tls=(cert, key),
                   heartbeat_interval=0.5)
    monkeypatch.setenv("DEEPFLEET_URL", c.url)
    monkeypatch.setenv("DEEPFLEET_API_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("DEEPFLEET_CA_BUNDLE", str(cert))
    try:
        job_file = tmp_path / "tls-ok.yaml"  # submitted with the CLI, over TLS
        job_file.write_text(json.dumps(tiny_gpt_job("tls-ok", steps=3, env={"DEEPFLEET_CA_BUNDLE": str(cert)})))
        submitted = CliRunner().invoke(app, ["submit", str(job_file)])
        assert submitted.exit_code == 0, submitted.output
        trusted = {"id": submitted.output.split(" as ")[1].split()[0]}
        refused = c.client.submit(json.dumps(tiny_gpt_job("tls-wrong", steps=3,
                                                          env={"DEEPFLEET_CA_BUNDLE": str(wrong)})),
                                  content_type="application/json")
        for job in (trusted, refused):  # heartbeats are best effort: training finishes either way
            done = wait_phase(c.client, job["id"], {"SUCCEEDED", "FAILED"}, timeout=300)
            assert done["phase"] == "SUCCEEDED", c.client.logs(job["id"], tail=30)

        beats = c.client.metrics(trusted["id"])
        assert beats and beats[-1]["step"] == 3 and beats[-1]["loss"] is not None
        assert "CERTIFICATE_VERIFY_FAILED" not in c.client.logs(trusted["id"])
        shown = CliRunner().invoke(app, ["get", trusted["id"]])
        assert shown.exit_code == 0, shown.output
        view = json.loads(shown.output)
        assert view["phase"] == "SUCCEEDED" and view["step"] == 3 and view["last_heartbeat"]["step"] == 3

        assert c.client.metrics(refused["id"]) == [] and c.client.get(refused["id"])["last_heartbeat"] is None
        log = c.client.logs(refused["id"])
        assert f"heartbeat to {c.url}/v1/jobs/{refused['id']}/heartbeat failed" in log, log[-3000:]
        assert "CERTIFICATE_VERIFY_FAILED" in log
    finally:
        c.client.close()
        c.stop()


def test_tls_flags_go_together(tmp_path: Path) -> None:
    from deepfleet.controller.server import main

    assert main(["--tls-cert", str(tmp_path / "c.pem"), "--data-dir", str(tmp_path)]) == 2
    assert main(["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem"),
                 "--data-dir", str(tmp_path)]) == 2
