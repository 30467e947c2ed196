"""Certificates made for a test run with `cryptography`: a CA, a server certificate for
127.0.0.1 and localhost, a client certificate from the same CA and one from a stranger CA."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # signed by another CA: a mutual-TLS server refuses it
    stranger_key: Path

    def client_context(self, with_cert: bool = False, stranger: bool = False) -> ssl.SSLContext:
        """A client's TLS context trusting our CA, presenting a certificate if asked."""
        context = ssl.create_default_context(cafile=str(self.ca))
        if stranger:
            context.load_cert_chain(self.stranger_cert, self.stranger_key)
        elif with_cert:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    issuer_name = issuer[0].subject if issuer else _name(subject)
    signer = issuer[1] if issuer else key
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    if issuer:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer[1].public_key()), False
        )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signer, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    ca_key, stranger_ca_key = key(), key()
    ca = _issue("moeserve test CA", ca_key, None, ca=True)
    stranger_ca = _issue("some other CA", stranger_ca_key, None, ca=True)
    files = {}
    for name, subject, issuer, server in (
        ("server", "127.0.0.1", (ca, ca_key), True),
        ("client", "team-a client", (ca, ca_key), False),
        ("stranger", "stranger client", (stranger_ca, stranger_ca_key), False),
    ):
        k = key()
        _write(directory / name, k, _issue(subject, k, issuer, server=server))
        files[name] = (directory / f"{name}.pem", directory / f"{name}.key")
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return Pki(
        directory / "ca.pem",
        *files["server"],
        *files["client"],
        *files["stranger"],
    )
