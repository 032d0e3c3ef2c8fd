"""The workers' channel: TLS (optionally mutual) and a shared bearer token.

A worker listens with `ServerSecurity`: its certificate and key, optionally a
client CA (then only clients with a certificate it signed get a handshake:
mutual TLS) and a token. `TokenInterceptor` answers UNAUTHENTICATED to a call
without `authorization: Bearer <token>`; health checks need no token (they
carry nothing, and kubelet gRPC probes cannot send one). A client dials with
`ClientSecurity`: the CA that signed the workers' certificates, its own
certificate for mutual TLS, the token, and optionally the name the workers'
certificate is for (pods are dialled by IP). `None` for either is plaintext,
which the commands allow only with an explicit `--insecure`.

`issue(directory, hosts)` writes a fresh CA, a server and a client certificate
and a token: what `specsplit serve` gives its children, and what
`specsplit certs` writes for a cluster's Secret.
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
TOKEN_HEADER = "authorization"
FILES = ("ca.crt", "server.crt", "server.key", "client.crt", "client.key", "token")
VALID_DAYS = 365


@dataclass(frozen=True)
class ServerSecurity:
    cert: bytes  # PEM certificate chain the worker presents
    key: bytes  # its PEM private key
    client_ca: bytes | None = None  # PEM CA; set = clients must present a certificate it signed
    token: str | None = None  # set = calls must carry "authorization: Bearer <token>"

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class ClientSecurity:
    ca: bytes  # PEM CA that signed the workers' certificates
    cert: bytes | None = None  # PEM client certificate chain, for mutual TLS
    key: bytes | None = None  # its PEM private key
    token: str | None = None  # sent as "authorization: Bearer <token>" on every call
    server_name: str | None = None  # the name the workers' certificate is for; None = the host

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_HEADER, f"Bearer {self.token}"),) if self.token else ()


def client_of(directory: Path) -> ClientSecurity:
    """The gateway's side of what `issue` wrote into `directory`."""
    files = {name: (directory / name).read_bytes() for name in FILES}
    token = files["token"].decode().strip()
    return ClientSecurity(files["ca.crt"], files["client.crt"], files["client.key"], token)


def read_token(path: Path | None) -> str | None:
    return None if path is None else path.read_text().strip()


def read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries the shared token."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(HEALTH_PREFIX) or self.authorized(details.invocation_metadata):
            return await continuation(details)
        return grpc.unary_unary_rpc_method_handler(refuse)

    def authorized(self, metadata) -> bool:
        sent = dict(metadata or ()).get(TOKEN_HEADER, "")
        sent = sent.encode() if isinstance(sent, str) else sent
        return hmac.compare_digest(sent, self.expected)


async def refuse(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")


def issue(directory: Path, hosts: list[str]) -> None:
    """Writes FILES into `directory` (private to the user): a CA, a server certificate for
    `hosts` (DNS names or IP addresses), a client certificate, both signed by the CA, and a
    random token."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def alt(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())

    def certificate(subject, key, issuer, extensions) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(ca_key, hashes.SHA256())

    ca_name = name("specsplit worker CA")
    ca = certificate(ca_name, ca_key, ca_name, [(x509.BasicConstraints(True, None), True)])

    def leaf(common: str, usage, names: list[str]):
        key = ec.generate_private_key(ec.SECP256R1())
        extensions = [
            (x509.BasicConstraints(False, None), True),
            (x509.ExtendedKeyUsage([usage]), False),
        ]
        if names:
            extensions.append((x509.SubjectAlternativeName([alt(h) for h in names]), False))
        return certificate(name(common), key, ca_name, extensions), key

    server, server_key = leaf(hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, hosts)
    client, client_key = leaf("specsplit gateway", ExtendedKeyUsageOID.CLIENT_AUTH, [])

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    contents = {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "server.crt": server.public_bytes(serialization.Encoding.PEM),
        "server.key": pem_key(server_key),
        "client.crt": client.public_bytes(serialization.Encoding.PEM),
        "client.key": pem_key(client_key),
        "token": secrets.token_urlsafe(32).encode(),
    }
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for file, content in contents.items():
        fd = os.open(directory / file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(content)
