"""A configured PREFECT_API_URL is checked before a run (server/embedded_server.check_api_reachable). Over TLS its
certificate is verified, as Prefect's client verifies it: only the embedded server's own loopback clients, which
speak plain HTTP, load no CA bundle."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import pytest
from support.file_server import file_server

from sft_tokenize.server.embedded_server import ServerUnavailable, check_api_reachable

HEALTH = {"/api/health": b"true"}


def self_signed(tmp_path: Path) -> ssl.SSLContext:
    """A server context with a certificate for 127.0.0.1 that no CA signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(key, hashes.SHA256()))
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key_file)
    return context


def test_a_configured_api_that_answers_passes_the_check():
    with file_server(HEALTH) as served:
        assert check_api_reachable(f"{served.endpoint}/api", timeout=2) is None


def test_a_configured_https_api_whose_certificate_no_ca_signed_is_refused(tmp_path):
    with file_server(HEALTH, tls=self_signed(tmp_path)) as served:
        with pytest.raises(ServerUnavailable, match=r"does not answer .*CERTIFICATE_VERIFY_FAILED"):
            check_api_reachable(f"{served.endpoint}/api", timeout=1)
        assert served.requests == {}  # the handshake failed: no request was read
