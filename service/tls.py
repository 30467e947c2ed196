"""TLS for both APIs from the same files: --ssl-certfile and --ssl-keyfile (PEM), and with
--ssl-ca-certs mutual TLS, where a client must present a certificate signed by those CAs.

The files are read and checked once at start-up (a wrong path or a key that does not match
the certificate stops the server with a message naming the flag); uvicorn gets the paths,
grpc.aio the bytes. Probes and /metrics are on the REST listener, so they follow it too.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from service.settings import Settings


class TlsConfigError(ValueError):
    """The TLS flags or files cannot be used (the message names the flag)."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    certfile: Path
    keyfile: Path
    ca_certs: Path | None

    @classmethod
    def from_settings(cls, settings: Settings) -> TlsFiles | None:
        """None when TLS is off (no --ssl-certfile); TlsConfigError for a partial or unusable
        set of files."""
        cert, key, ca = settings.ssl_certfile, settings.ssl_keyfile, settings.ssl_ca_certs
        if not cert:
            if key or ca:
                given = "--ssl-keyfile" if key else "--ssl-ca-certs"
                raise TlsConfigError(f"{given} needs --ssl-certfile")
            return None
        if not key:
            raise TlsConfigError("--ssl-certfile needs --ssl-keyfile (the certificate's key)")
        files = cls(Path(cert), Path(key), Path(ca) if ca else None)
        files.check()
        return files

    @property
    def mode(self) -> str:
        """How the "server started" line describes it: "tls" or "mutual"."""
        return "mutual" if self.ca_certs else "tls"

    def check(self) -> None:
        """Loads the files as a server would (TlsConfigError naming the flag otherwise)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(
                f"--ssl-certfile {self.certfile} / --ssl-keyfile {self.keyfile}: {_reason(exc)}"
            ) from None
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as exc:
                raise TlsConfigError(f"--ssl-ca-certs {self.ca_certs}: {_reason(exc)}") from None

    def uvicorn_options(self) -> dict:
        return {
            "ssl_certfile": str(self.certfile),
            "ssl_keyfile": str(self.keyfile),
            "ssl_ca_certs": None if self.ca_certs is None else str(self.ca_certs),
            "ssl_cert_reqs": ssl.CERT_REQUIRED if self.ca_certs else ssl.CERT_NONE,
        }

    def grpc_credentials(self) -> grpc.ServerCredentials:
        ca = self.ca_certs.read_bytes() if self.ca_certs else None
        return grpc.ssl_server_credentials(
            [(self.keyfile.read_bytes(), self.certfile.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


def _reason(exc: OSError | ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)  # e.g. KEY_VALUES_MISMATCH, NO_CERTIFICATE_OR_CRL_FOUND
    return exc.strerror or str(exc)
