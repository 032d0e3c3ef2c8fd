"""`specsplit certs DIR`: credentials for the workers' TLS channel.

    specsplit certs tls --hosts specsplit-target,specsplit-draft
    kubectl -n specsplit create secret generic specsplit-worker-tls --from-file=tls

Writes into DIR (private to the user) a fresh CA (ca.crt), a worker
certificate for the hosts (server.crt, server.key), a gateway certificate for
mutual TLS (client.crt, client.key) and a random token (token). The CA's key
is not kept: to add a host, make a new set and roll it out.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, CliPositionalArg

from workers.rpc.security import FILES, issue
from workers.settings import parse, settings_config


class CertsSettings(BaseSettings):
    model_config = settings_config("certs")

    directory: CliPositionalArg[Path] = Field(description="where to write " + ", ".join(FILES))
    hosts: str = Field(
        "localhost,127.0.0.1",
        description="comma list of the names and addresses gateways dial the workers by; with "
        "pods dialled by IP, the gateway's --worker-tls-name must be one of them",
    )


def main(argv: list[str]) -> None:
    s = parse(CertsSettings, argv)
    hosts = [h.strip() for h in s.hosts.split(",") if h.strip()]
    issue(s.directory, hosts)
    print(f"wrote {', '.join(FILES)} to {s.directory} for {', '.join(hosts)}")
