"""How kvplane authenticates to etcd: TLS (the servers' CA, a client certificate for etcd's
`--client-cert-auth`) and etcd's own users (user and password).

With a user, the client asks etcd's Auth service for a token once and sends it with every
call (`token` metadata); a call refused for an invalid or expired token makes the next call
ask for a new one. The store's channels are made here (`channel`), so the store itself knows
nothing of credentials. A TLS channel is made again when its certificate files change
(`ReloadingChannel`): a renewed client certificate is presented without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from aetcd import rpc

from kvplane.services.common.runtime.reloading_channel import ReloadingChannel
from kvplane.services.common.runtime.secret_files import SecretFileError, read_secret_file
from kvplane.services.common.runtime.tls import ClientTlsFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EtcdCredentials:
    """Empty: plaintext and no etcd user (a loopback etcd only)."""

    # PEM files: the CA etcd's certificates chain to (set: TLS), and this client's certificate.
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    # The name etcd's certificate is checked against, when it is not the endpoint's host.
    server_name: str = ""
    # etcd's own authentication (`etcdctl auth enable`); empty user: none.
    user: str = ""
    password: str = field(default="", repr=False)
    # A file holding the password, read again whenever etcd is asked for a token (after a refused
    # one): a password rotated in the file and in etcd is used without a restart. `password` is
    # its content at start-up.
    password_file: str = ""

    def __post_init__(self) -> None:
        if (self.cert_file or self.key_file) and not self.ca_file:
            raise ValueError("an etcd client certificate needs ca_file (etcd's CA)")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("an etcd client certificate needs both cert_file and key_file")
        if bool(self.user) != bool(self.password):
            raise ValueError("etcd authentication needs both user and password")

    @property
    def tls(self) -> bool:
        return bool(self.ca_file)

    def current_password(self) -> str:
        """The password file's content now (the start-up one if it cannot be read), or `password`."""
        if not self.password_file:
            return self.password
        try:
            return read_secret_file(self.password_file, "etcd password")
        except SecretFileError as exc:
            log.warning("etcd password file cannot be read; using the previous password: %s", exc)
            return self.password

    def channel(self, target: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        """A channel to one etcd member with these credentials."""
        opts = list(options)
        interceptors = [_TokenInterceptor(self, target)] if self.user else None
        if not self.tls:
            return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        files = ClientTlsFiles(self.ca_file, self.cert_file, self.key_file)
        return ReloadingChannel(target, files, options=opts, interceptors=interceptors)

    def bare_channel(self, target: str) -> grpc.aio.Channel:
        """The same transport without the token (to ask etcd for one)."""
        if not self.tls:
            return grpc.aio.insecure_channel(target)
        opts = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return ReloadingChannel(
            target, ClientTlsFiles(self.ca_file, self.cert_file, self.key_file), options=opts
        )


class _TokenInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Adds etcd's auth token to every call; a refused token is asked for again next time."""

    def __init__(self, credentials: EtcdCredentials, target: str) -> None:
        self._credentials = credentials
        self._target = target
        self._token = ""
        self._lock = asyncio.Lock()
        self._checks: set[asyncio.Future[None]] = set()

    async def _current(self) -> str:
        async with self._lock:
            if not self._token:
                async with self._credentials.bare_channel(self._target) as channel:
                    reply = await rpc.AuthStub(channel).Authenticate(
                        rpc.AuthenticateRequest(
                            name=self._credentials.user, password=self._credentials.current_password()
                        ),
                        timeout=5,
                    )
                self._token = str(reply.token)
            return self._token

    async def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        try:
            metadata.add("token", await self._current())
        except grpc.aio.AioRpcError as exc:
            # Said once per failure, where operators look: the store is about to fail too.
            log.warning("etcd refused user %r: %s %s", self._credentials.user, exc.code().name, exc.details())
            raise
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    def _watch(self, call: Any) -> Any:
        async def check(finished: Any) -> None:
            if finished.cancelled():
                return
            code, details = await finished.code(), (await finished.details()) or ""
            if code == grpc.StatusCode.UNAUTHENTICATED or (
                code != grpc.StatusCode.OK and "token" in details.lower()
            ):
                self._token = ""  # expired or revoked: the next call authenticates again

        def done(finished: Any) -> None:
            task = asyncio.ensure_future(check(finished))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

        call.add_done_callback(done)
        return call

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return self._watch(await continuation(await self._details(details), request))

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return self._watch(await continuation(await self._details(details), request))

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return self._watch(await continuation(await self._details(details), requests))

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return self._watch(await continuation(await self._details(details), requests))
