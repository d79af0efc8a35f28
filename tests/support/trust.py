"""What the trust-boundary tests share: every kvplane gRPC method, raw calls, and a control plane
(metadata, routing and eviction in one process) in a chosen authentication mode."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

import kvplane.v1
from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.services.settings import KvplaneSettings

# Tokens of the token-mode plane: two nodes, two tenants, an operator.
TOKENS = {
    "node-a": ("node", "node-a"),
    "node-b": ("node", "node-b"),
    "acme": ("tenant", "acme"),
    "globex": ("tenant", "globex"),
    "ops": ("operator", "ops"),
}


def token_of(name: str) -> str:
    return f"token-of-{name}-0123456789abcdef"


def bearer(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token_of(name)}"),)


def kvplane_services() -> list[ServiceDescriptor]:
    """Every service the API declares, found from the generated modules: a new one is not missed."""
    found: dict[str, ServiceDescriptor] = {}
    for info in pkgutil.iter_modules(kvplane.v1.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"kvplane.v1.{info.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                found[service.full_name] = service
    return [found[name] for name in sorted(found)]


def all_methods() -> list[tuple[ServiceDescriptor, MethodDescriptor]]:
    return [(s, m) for s in kvplane_services() for m in s.methods]


def method_id(pair: tuple[ServiceDescriptor, MethodDescriptor]) -> str:
    return f"{pair[0].name}.{pair[1].name}"


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: int


async def raw_call(
    channel: grpc.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    payloads: Sequence[bytes],
    metadata: Sequence[tuple[str, str]] = (),
    timeout_s: float = 5.0,
) -> Outcome:
    """Calls `method` with request messages given as wire bytes; the status and responses count.

    Through gRPC's synchronous client (in a thread): when a server ends a client-streaming call
    before reading it (a refusal), grpc.aio's client can report its own INTERNAL ("Internal error
    from Core") in place of the server's status if its write loses the race with the server's
    reset (grpc/grpc#36066); the synchronous client always reports what the server sent.
    """
    return await asyncio.to_thread(_raw_call, channel, service, method, payloads, metadata, timeout_s)


def _raw_call(
    channel: grpc.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    payloads: Sequence[bytes],
    metadata: Sequence[tuple[str, str]],
    timeout_s: float,
) -> Outcome:
    path = f"/{service.full_name}/{method.name}"
    responses = 0
    try:
        if method.client_streaming:
            for _ in channel.stream_stream(path)(iter(payloads), metadata=metadata, timeout=timeout_s):
                responses += 1
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(payloads[0], metadata=metadata, timeout=timeout_s):
                responses += 1
        else:
            channel.unary_unary(path)(payloads[0], metadata=metadata, timeout=timeout_s)
            responses = 1
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return Outcome(exc.code(), exc.details() or "", responses)
    return Outcome(grpc.StatusCode.OK, "", responses)


def raw_channel(target_address: str, credentials: ClientCredentials | None = None) -> grpc.Channel:
    """A synchronous channel for `raw_call`: plaintext, or TLS with `credentials`' files."""
    if credentials is None or not credentials.tls:
        return grpc.insecure_channel(target_address)
    cert_chain = Path(credentials.tls_cert_file).read_bytes() if credentials.tls_cert_file else None
    key = Path(credentials.tls_key_file).read_bytes() if credentials.tls_key_file else None
    tls = grpc.ssl_channel_credentials(Path(credentials.tls_ca_file).read_bytes(), key, cert_chain)
    options = (
        [("grpc.ssl_target_name_override", credentials.tls_server_name)]
        if credentials.tls_server_name
        else []
    )
    return grpc.secure_channel(target_address, tls, options=options)


def plane_settings(
    etcd_server: LocalEtcd, prefix: str, auth: dict[str, Any], **sections: Any
) -> KvplaneSettings:
    values: dict[str, Any] = {
        "grpc": {"listen": f"127.0.0.1:{free_port()}", "grace_s": 0.2},
        "etcd": {"endpoints": [etcd_server.endpoint], "prefix": prefix},
        "telemetry": {"metrics_port": 0, "json_logs": False},
        "eviction": {"lease_ttl_s": 2, "evaluate_interval_s": 0.2, "policy": {"policies": []}},
        "auth": auth,
    }
    for key, value in sections.items():
        values[key] = {**values.get(key, {}), **value}
    return KvplaneSettings.model_validate(values)


def token_auth() -> dict[str, Any]:
    return {
        "mode": "token",
        "tokens": [{"token": token_of(n), "kind": k, "name": name} for n, (k, name) in TOKENS.items()],
    }


async def start_plane(settings: KvplaneSettings) -> ServiceProcess:
    from kvplane.services.cli import installers

    process = ServiceProcess(settings, installers(["metadata", "routing", "eviction"]), Telemetry.disabled())
    await process.start()
    return process


def target(process: ServiceProcess) -> str:
    return f"127.0.0.1:{process.grpc_port}"


class MeshOperatorCalls(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Makes every unary call of a channel an operator's, as a mesh proxy would name it
    (for tests whose helpers call stubs without metadata)."""

    def __init__(self, secret: str) -> None:
        self._headers = (("x-kvplane-mesh-secret", secret), ("x-kvplane-role", "operator"))

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = grpc.aio.Metadata(*self._headers, *(details.metadata or ()))
        return await continuation(
            grpc.aio.ClientCallDetails(
                details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
            ),
            request,
        )
