"""A gRPC channel over TLS that is made again when its certificate files change.

gRPC reads a client's CA, certificate and key once, when the channel is made; a client that
lives longer than its certificate (node agents, the gateway's routing client) would present an
expired one, or keep trusting a retired CA, until it restarts. `ReloadingChannel` stands in for
the channel: each call checks the files (at most once a second: a few `stat` calls), and when
one changed, calls from then on go over a new channel made from the new files. Calls in flight
finish on the old channel, which is closed after a grace period. Stubs made on it keep working,
because the multi-callables they hold look the current channel up at each call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import grpc

from kvplane.services.common.runtime.secret_files import FileStamp, file_stamp
from kvplane.services.common.runtime.tls import ClientTlsFiles, TlsConfigError

log = logging.getLogger(__name__)

# How long calls in flight on a replaced channel may take before it is closed under them, seconds.
OLD_CHANNEL_GRACE_S = 60.0


class _CurrentCallable:
    """A multi-callable that runs on whichever channel is current when it is called."""

    def __init__(
        self, owner: ReloadingChannel, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._owner = owner
        self._kind = kind
        self._args = args
        self._kwargs = kwargs
        self._made_on: grpc.aio.Channel | None = None
        self._callable: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        if channel is not self._made_on:
            self._callable = getattr(channel, self._kind)(*self._args, **self._kwargs)
            self._made_on = channel
        return self._callable(*args, **kwargs)


class ReloadingChannel(grpc.aio.Channel):
    """A secure grpc.aio channel to `target`, made again when the TLS files change."""

    def __init__(
        self,
        target: str,
        files: ClientTlsFiles,
        *,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Any] | None = None,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._target = target
        self._files = files
        self._options = list(options)
        self._interceptors = interceptors
        self._interval = check_interval_s
        self._clock = clock
        self._paths = tuple(p for p in (files.ca_file, files.cert_file, files.key_file) if p)
        self._stamps = self._read_stamps()
        # Fails loudly at start-up: a client never runs with credentials it could not read.
        self._channel = self._make()
        self._next_check = clock() + check_interval_s
        # Replaced channels still finishing their calls, and the tasks that close them.
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None]] = {}
        self.reloads = 0

    def _read_stamps(self) -> tuple[FileStamp, ...]:
        return tuple(file_stamp(p) for p in self._paths)

    def _make(self) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(
            self._target,
            self._files.channel_credentials(),
            options=self._options,
            interceptors=self._interceptors,
        )

    def current(self) -> grpc.aio.Channel:
        """The channel calls go over now, made again first if the files changed."""
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self._interval
            stamps = self._read_stamps()
            if stamps != self._stamps:
                self._stamps = stamps
                self._replace()
        return self._channel

    def _replace(self) -> None:
        try:
            new = self._make()
        except TlsConfigError as exc:
            log.warning("TLS files changed but cannot be read; keeping the current channel: %s", exc)
            return
        old, self._channel = self._channel, new
        self.reloads += 1
        log.info("client TLS files changed: new channel", extra={"target": self._target})
        self._retire(old)

    def _retire(self, old: grpc.aio.Channel) -> None:
        try:
            task = asyncio.get_running_loop().create_task(old.close(grace=OLD_CHANNEL_GRACE_S))
        except RuntimeError:
            return  # no loop: the channel is garbage-collected with its calls
        self._retired[old] = task
        task.add_done_callback(lambda _: self._retired.pop(old, None))

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        # Replaced channels get the same grace as the current one, not their own minute.
        retired = list(self._retired.items())
        for _, task in retired:
            task.cancel()
        for old, _ in retired:
            await old.close(grace)
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> grpc.aio.UnaryUnaryMultiCallable[Any, Any]:
        return cast(
            grpc.aio.UnaryUnaryMultiCallable[Any, Any], _CurrentCallable(self, "unary_unary", args, kwargs)
        )

    def unary_stream(self, *args: Any, **kwargs: Any) -> grpc.aio.UnaryStreamMultiCallable[Any, Any]:
        return cast(
            grpc.aio.UnaryStreamMultiCallable[Any, Any], _CurrentCallable(self, "unary_stream", args, kwargs)
        )

    def stream_unary(self, *args: Any, **kwargs: Any) -> grpc.aio.StreamUnaryMultiCallable[Any, Any]:
        return cast(
            grpc.aio.StreamUnaryMultiCallable[Any, Any], _CurrentCallable(self, "stream_unary", args, kwargs)
        )

    def stream_stream(self, *args: Any, **kwargs: Any) -> grpc.aio.StreamStreamMultiCallable[Any, Any]:
        return cast(
            grpc.aio.StreamStreamMultiCallable[Any, Any],
            _CurrentCallable(self, "stream_stream", args, kwargs),
        )
