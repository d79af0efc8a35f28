"""`kvplane health`, the exec probe for a control plane serving TLS: SERVING exits 0, anything else
exits 1 and says why."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.runtime.auth import TokenAuthenticator
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.server import GrpcServer
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.health_probe import check, main


@pytest.fixture
async def server() -> AsyncIterator[str]:
    served = GrpcServer("127.0.0.1:0", Telemetry.disabled(), TokenAuthenticator({}))
    port = await served.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await served.stop(0.1)


async def test_a_serving_server_reads_serving_without_credentials(server: str) -> None:
    assert await check(server, "", ClientCredentials(), timeout_s=10) == "SERVING"


async def test_a_service_the_server_does_not_have_is_not_found(server: str) -> None:
    status = await check(server, "kvplane.v1.NoSuchService", ClientCredentials(), timeout_s=10)
    assert status.startswith("NOT_FOUND")


async def test_bad_tls_settings_are_reported_not_raised(server: str) -> None:
    credentials = ClientCredentials(tls_ca_file="/nonexistent/ca.pem")
    assert (await check(server, "", credentials, timeout_s=10)).startswith("bad TLS settings")


def test_nothing_listening_exits_1_naming_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{free_port()}"
    assert main([target, "--timeout-s", "2"], env={}) == 1
    assert f"kvplane health: {target} (server): UNAVAILABLE" in capsys.readouterr().err


def test_a_client_certificate_without_the_servers_ca_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["127.0.0.1:1", "--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"]
    assert main(argv, env={}) == 1
    assert "needs tls_ca_file" in capsys.readouterr().err


@pytest.fixture
def http_servers() -> Iterator[tuple[str, str]]:
    """One HTTP server answering /health 200, one answering 503."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.server.server_port == ok.server_port else 503)  # type: ignore[attr-defined]
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    ok = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    bad = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (ok, bad)]
    for t in threads:
        t.start()
    try:
        yield f"http://127.0.0.1:{ok.server_port}/health", f"http://127.0.0.1:{bad.server_port}/health"
    finally:
        for s in (ok, bad):
            s.shutdown()
            s.server_close()


def test_http_targets_must_all_answer_2xx(
    http_servers: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    ok, bad = http_servers
    assert main([ok], env={}) == 0
    assert main([ok, bad, "--timeout-s", "2"], env={}) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"kvplane health: {bad}: HTTP 503"


def test_an_http_target_may_name_this_host(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    assert main(["http://{hostname}:1/health", "--timeout-s", "2"], env={}) == 1
    assert f"http://{socket.gethostname()}:1/health: unreachable" in capsys.readouterr().err
