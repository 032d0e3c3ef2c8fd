"""The workers' channel on a real worker: mutual TLS and the token let the gateway in and
keep everyone else out; health stays open for probes; plaintext needs --insecure."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.settings import GatewaySettings
from tests.engine.tiny import tiny_engine
from tests.workers.helpers import settings
from workers.protocol import VerifyCall, WorkerDown
from workers.rpc.client import GrpcBackend
from workers.rpc.security import FILES, client_of, issue
from workers.rpc.service import serve_role
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree
from workers.tools import cli
from workers.worker import WorkerSettings


def secured(directory) -> dict:
    """A worker's settings for mutual TLS with a token, with credentials in `directory`."""
    issue(directory, ["127.0.0.1"])
    return dict(
        insecure=False, tls_cert=directory / "server.crt", tls_key=directory / "server.key",
        tls_client_ca=directory / "ca.crt", token_file=directory / "token",
    )  # fmt: skip


@pytest.fixture
async def tls_worker(tmp_path):
    """An n-gram draft worker serving mutual TLS with a token, and its credentials."""
    server = await serve_role("draft", None, settings("draft", **secured(tmp_path)))
    try:
        yield f"127.0.0.1:{server.port}", server.health_port, client_of(tmp_path)
    finally:
        await server.shutdown(0)


async def refusal(address: str, security=None) -> grpc.aio.AioRpcError:
    async with GrpcBackend("draft", address, 5.0, security) as backend:
        with pytest.raises(WorkerDown) as refused:
            await backend.info()
    return refused.value.__cause__


async def test_the_gateways_credentials_get_in(tls_worker):
    address, _, security = tls_worker
    async with GrpcBackend("draft", address, 5.0, security) as draft:
        assert (await draft.info()).role == "draft"
        assert await draft.health()


async def test_a_plaintext_client_gets_no_handshake(tls_worker):
    address, _, _ = tls_worker
    assert (await refusal(address)).code() == grpc.StatusCode.UNAVAILABLE


async def test_a_client_without_a_certificate_gets_no_handshake(tls_worker):
    address, _, security = tls_worker
    no_certificate = replace(security, cert=None, key=None)
    assert (await refusal(address, no_certificate)).code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", ["wrong", None])
async def test_a_wrong_or_missing_token_is_unauthenticated(tls_worker, token):
    address, _, security = tls_worker
    error = await refusal(address, replace(security, token=token))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_targets_verify_stream_lets_the_token_in_and_keeps_others_out(tmp_path):
    server = await serve_role(
        "target", tiny_engine(seed=1), settings("target", **secured(tmp_path))
    )
    address, security = f"127.0.0.1:{server.port}", client_of(tmp_path)
    start = VerifyCall("a", 0, [5, 17, 3], TokenTree.empty(), SamplingParams())
    try:
        async with GrpcBackend("target", address, 5.0, security) as target:
            assert len((await target.verify(start)).emitted) == 1 and target.streaming
        async with GrpcBackend("target", address, 5.0, replace(security, token="wrong")) as target:
            with pytest.raises(WorkerDown, match="UNAUTHENTICATED"):
                await target.verify(replace(start, session_id="b"))
            assert target.streaming  # refused, not mistaken for a worker without streams
    finally:
        await server.shutdown(0)


async def test_health_needs_no_token_and_has_a_plaintext_port_for_probes(tls_worker):
    address, health_port, security = tls_worker
    async with GrpcBackend("draft", address, 5.0, replace(security, token=None)) as draft:
        assert await draft.health()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert (await check).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as only_health:
            await channel.unary_unary("/specsplit.v1.DraftService/Info")(b"")
        assert only_health.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_only_when_asked():
    with pytest.raises(ValueError, match="--insecure"):
        WorkerSettings(role="target").security()
    assert WorkerSettings(role="target", insecure=True).security() is None
    with pytest.raises(ValueError, match="--insecure"):
        GatewaySettings(target_addresses="127.0.0.1:50051").worker_security()
    assert GatewaySettings(insecure=True).worker_security() is None


def test_certs_writes_private_files_for_the_hosts(tmp_path, capsys):
    from cryptography import x509

    cli.main(["certs", str(tmp_path / "tls"), "--hosts", "specsplit-worker,10.0.0.7"])
    assert "specsplit-worker, 10.0.0.7" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == sorted(FILES)
    assert (tmp_path / "tls").stat().st_mode & 0o777 == 0o700
    assert {(p.stat().st_mode & 0o777) for p in (tmp_path / "tls").iterdir()} == {0o600}
    server = x509.load_pem_x509_certificate((tmp_path / "tls" / "server.crt").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["specsplit-worker"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
