"""`specsplit gateway`: the OpenAI-compatible gateway over draft and target worker pools.

    specsplit gateway --target-addresses target-0:50061,target-1:50061 \
                      --draft-addresses drafts.specsplit.svc:50051 \
                      --worker-ca tls/ca.crt --worker-token-file tls/token

The workers are reached over TLS (`--worker-ca`, with `--worker-cert` and
`--worker-key` for mutual TLS and `--worker-token-file` for their token);
plaintext only with `--insecure`.

Without --draft-addresses the draft runs inside the gateway (--local-draft
ngram, the default) or not at all (--local-draft none).
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings
from workers.settings import parse


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def main(argv: list[str]) -> None:
    settings = parse(GatewaySettings, argv)
    configure_logging(settings.log_level)
    try:
        settings.worker_security()  # the same check the app makes, before it starts
    except (ValueError, OSError) as error:
        sys.exit(f"specsplit gateway: {error}")
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=5,
    )
