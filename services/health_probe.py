"""`kvplane health`: asks a kvplane gRPC server whether it serves, over TLS or mTLS if need be, or
HTTP servers whether they answer.

Kubernetes' built-in gRPC probe speaks plaintext only, so a control plane serving TLS is probed
by running this command in its container (an exec probe). It calls the standard gRPC health
service, which needs no principal; the TLS handshake still needs the CA and, for mTLS, a client
certificate. A target that is an http:// or https:// URL is fetched instead (an engine's or the
gateway's /health), `{hostname}` in it replaced by the container's host name; with several
targets, all must answer. The images' health checks (compose) run this, one argument list with
no shell and no inline code. Exit status: 0 when every target serves, 1 otherwise, with the
reason on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.runtime.tls import TlsConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplane health",
        description="exit 0 when a kvplane gRPC server serves; for Kubernetes exec probes over TLS",
        epilog="Credentials may also come from KVPLANE_CLIENT_TLS_CA_FILE, ..._TLS_CERT_FILE, "
        "..._TLS_KEY_FILE and ..._TLS_SERVER_NAME; a flag wins.",
    )
    p.add_argument(
        "targets",
        nargs="+",
        metavar="target",
        help="host:port of a gRPC server (a probe: 127.0.0.1:<port>), or an http(s):// URL that must "
        "answer 2xx ({hostname}: this host's name); several: all must serve",
    )
    p.add_argument("--service", default="", help='health service name ("": the server as a whole)')
    p.add_argument("--tls-ca-file", default="", help="CA of the server's certificate; set: TLS")
    p.add_argument("--tls-cert-file", default="", help="client certificate, for a server requiring mTLS")
    p.add_argument("--tls-key-file", default="", help="the client certificate's key")
    p.add_argument(
        "--tls-server-name", default="", help="name to check the certificate against (default: the host)"
    )
    p.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the check, seconds")
    return p


async def check(target: str, service: str, credentials: ClientCredentials, timeout_s: float) -> str:
    """The serving status's name (SERVING, NOT_SERVING, ...) or why the server gave none."""
    try:
        channel = credentials.channel(target)
    except TlsConfigError as exc:
        return f"bad TLS settings: {exc}"
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        credentials = ClientCredentials.from_env(env if env is not None else _environ()).merged(
            tls_ca_file=args.tls_ca_file,
            tls_cert_file=args.tls_cert_file,
            tls_key_file=args.tls_key_file,
            tls_server_name=args.tls_server_name,
        )
    except (TypeError, ValueError) as exc:
        print(f"kvplane health: {exc}", file=sys.stderr)
        return 1
    failed = 0
    for target in args.targets:
        if target.startswith(("http://", "https://")):
            url = target.replace("{hostname}", socket.gethostname())
            status = check_http(url, args.timeout_s)
            what = url
        else:
            status = asyncio.run(check(target, args.service, credentials, args.timeout_s))
            what = f"{target} {args.service or '(server)'}"
        if status != "SERVING":
            print(f"kvplane health: {what}: {status}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def check_http(url: str, timeout_s: float) -> str:
    """SERVING when `url` answers 2xx, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return "SERVING" if 200 <= reply.status < 300 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return f"unreachable: {getattr(exc, 'reason', exc)}"


def _environ() -> Mapping[str, str]:
    # Only the TLS settings: a probe never presents a token (the health service needs none).
    return {k: v for k, v in os.environ.items() if k.startswith("KVPLANE_CLIENT_TLS_")}
