"""The NIXL side channel: a TCP handshake that hands a reader what it needs.

A reader connects, names the engine id it expects, and gets back the
holder's identity (engine id, incarnation), block geometry, its
``perf_counter`` reading (for the clock offset), its NIXL agent metadata and
its serialized block descriptors. The holder refuses a reader that expects
another engine id, as vLLM's handshake does.

Frame: 4-byte big-endian header length, a JSON header, then the binary blobs
whose lengths the header lists under ``blobs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_HEADER_BYTES = 1 << 16
MAX_BLOB_BYTES = 64 << 20


class HandshakeError(Exception):
    """The side-channel handshake failed or the peer is not the expected engine."""


def normalize_host(host: str) -> str:
    """Host without IPv6 brackets: '[::1]' and '::1' both give '::1'."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    return h


def format_host(host: str) -> str:
    """Host for kv_transfer_params and URLs: IPv6 literals bracketed, others unchanged."""
    h = normalize_host(host)
    try:
        if isinstance(ipaddress.ip_address(h), ipaddress.IPv6Address):
            return f"[{h}]"
    except ValueError:
        pass
    return h


@dataclass(frozen=True)
class PeerInfo:
    """What a handshake tells the reader about the holder."""

    engine_id: str
    incarnation: str
    model: str
    block_size: int
    bytes_per_block: int
    num_blocks: int
    registration_generation: int
    # holder's perf_counter minus ours, in seconds, measured at the handshake
    clock_offset_s: float
    agent_metadata: bytes
    serialized_descs: bytes


async def _write_frame(writer: asyncio.StreamWriter, header: dict[str, Any], blobs: list[bytes]) -> None:
    header = dict(header, blobs=[len(b) for b in blobs])
    raw = json.dumps(header).encode()
    writer.write(struct.pack("!I", len(raw)) + raw + b"".join(blobs))
    await writer.drain()


async def _read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], list[bytes]]:
    (n,) = struct.unpack("!I", await reader.readexactly(4))
    if n > MAX_HEADER_BYTES:
        raise HandshakeError(f"side-channel header of {n} bytes is too large")
    header = json.loads(await reader.readexactly(n))
    if not isinstance(header, dict):
        raise HandshakeError("side-channel header is not an object")
    blobs: list[bytes] = []
    for size in header.get("blobs", []):
        if not isinstance(size, int) or not 0 <= size <= MAX_BLOB_BYTES:
            raise HandshakeError(f"bad blob size {size!r}")
        blobs.append(await reader.readexactly(size))
    return header, blobs


@dataclass(frozen=True)
class LocalIdentity:
    """What this engine's side channel serves."""

    engine_id: str
    incarnation: str
    model: str
    block_size: int
    bytes_per_block: int
    num_blocks: int
    registration_generation: int
    agent_metadata: bytes
    serialized_descs: bytes


class SideChannelServer:
    """Answers handshakes for one engine."""

    def __init__(self, identity: Callable[[], LocalIdentity], host: str, port: int) -> None:
        self._identity = identity
        self._host = normalize_host(host)
        self._port = port
        self._server: asyncio.Server | None = None
        self.handshakes_served = 0

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                header, _ = await _read_frame(reader)
            me = self._identity()
            expect = header.get("expect_engine_id")
            if header.get("op") != "handshake":
                await _write_frame(writer, {"ok": False, "error": "unknown op"}, [])
            elif expect is not None and expect != me.engine_id:
                await _write_frame(
                    writer, {"ok": False, "error": f"engine id is {me.engine_id!r}, not {expect!r}"}, []
                )
            else:
                self.handshakes_served += 1
                await _write_frame(
                    writer,
                    {
                        "ok": True,
                        "engine_id": me.engine_id,
                        "incarnation": me.incarnation,
                        "model": me.model,
                        "block_size": me.block_size,
                        "bytes_per_block": me.bytes_per_block,
                        "num_blocks": me.num_blocks,
                        "registration_generation": me.registration_generation,
                        "perf_counter": time.perf_counter(),
                    },
                    [me.agent_metadata, me.serialized_descs],
                )
        except (OSError, asyncio.IncompleteReadError, TimeoutError, HandshakeError, ValueError):
            pass  # a broken peer only loses its own handshake
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def handshake(host: str, port: int, expect_engine_id: str | None, timeout_s: float) -> PeerInfo:
    """Fetch a holder's identity and NIXL registration; raises HandshakeError."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(normalize_host(host), port)
            try:
                t0 = time.perf_counter()
                await _write_frame(writer, {"op": "handshake", "expect_engine_id": expect_engine_id}, [])
                header, blobs = await _read_frame(reader)
                t1 = time.perf_counter()
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
        raise HandshakeError(f"side channel {format_host(host)}:{port}: {e!r}") from e
    if not header.get("ok"):
        raise HandshakeError(f"side channel {format_host(host)}:{port} refused: {header.get('error')}")
    if len(blobs) != 2:
        raise HandshakeError("handshake reply lacks metadata or descriptors")
    try:
        return PeerInfo(
            engine_id=str(header["engine_id"]),
            incarnation=str(header["incarnation"]),
            model=str(header["model"]),
            block_size=int(header["block_size"]),
            bytes_per_block=int(header["bytes_per_block"]),
            num_blocks=int(header["num_blocks"]),
            registration_generation=int(header["registration_generation"]),
            # The holder read its clock somewhere between our send and receive.
            clock_offset_s=float(header["perf_counter"]) - (t0 + t1) / 2,
            agent_metadata=blobs[0],
            serialized_descs=blobs[1],
        )
    except (KeyError, TypeError, ValueError) as e:
        raise HandshakeError(f"malformed handshake reply: {e!r}") from e
