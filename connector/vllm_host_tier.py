"""D's retained handles moved to vLLM's CPU offloading tier when D is short of KV blocks.

A decode engine run as `MultiConnector[kvplane's NixlConnector, vLLM's OffloadingConnector]`
copies the blocks it computes to host memory as they fill, and publishes each copy as a KV-cache
event on medium "CPU", which the node agent reads into its block set (`BlockSet` places a copy in
its chain, `self_describing_kv_events` or not). When requests wait for blocks, kvplane's connector
spills before it asks the control plane for memory, as the sim-engine does
(`simengine.retention`): retained handles whose first blocks the CPU tier holds, in the order
the control plane's leader last sent (least expected reuse per byte first; those it leaves out
after, oldest first), are republished as HOST-tier handles (`CacheHandle.relocates_handle_id`)
for that prefix, naming where the engine's offloading P2P tier serves them (`host_tier_p2p`,
host:port). A later turn's P reads the copies through vLLM's symmetric P2P (`remote_kv_source` in
its kv_transfer_params), by block hash, so it can read nothing but the prompt's own prefix.

The GPU blocks are freed only once the control plane has stored the move: until then a turn may
still check the device handle out and read them. A refused move (the handle was checked out,
released or superseded first) leaves them to whatever got there first.

The CPU copy is vLLM's, kept by its LRU, not kvplane's: a read frees nothing, and kvplane never
frees it. A moved handle is offered until `host_tier_ttl_s` after its turn (longer than D's TTL
would keep the GPU blocks: host memory is cheap). It ends when the CPU tier drops its first
block (`BlockRemoved` on "CPU"), when a release command names it (an unused claim, a newer
handle, a drain) or at its expiry; each end is reported released, once.

The control plane also moves a handle when its policies want the handle's GPU blocks back (a
MoveCommand in place of a release): the agent's thread checks that the CPU tier holds the
handle's first block (`refuses_move`), and the scheduler thread makes the move (`move`) as it
makes its own.

The connector's scheduler thread owns this object; the agent's thread only queues move outcomes
(`outcome`, under a lock) and checks a move (`refuses_move`); the block set is read one key at a
time (`NodeAgent.held_prefix`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvplane.connector import digests as token_digests
from kvplane.services.common.model.block_hashes import external_id
from kvplane.services.common.model.handles import KEY_REMOTE_KV_SOURCE, CacheHandle, KvTier


@dataclass(frozen=True, slots=True)
class _Tracked:
    """A published handle and what a move needs: vLLM's block ids of its whole blocks, in order,
    the tokens they hold (hashed into digests only for a move), the blocks it holds on the GPU."""

    handle: CacheHandle
    block_ids: tuple[int, ...]
    token_ids: Sequence[int]
    gpu_blocks: int
    # When it was published (its turn's end), ms since the Unix epoch.
    tracked_unix_ms: int


class HostTier:
    """The handles this engine may move to its CPU tier, the moves in flight, and the moved."""

    def __init__(
        self,
        p2p_endpoint: tuple[str, int],
        block_size: int,
        bytes_per_block: int,
        held_prefix: Callable[[Sequence[int]], int],
        ttl_s: float = 3600.0,
        clock_unix_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        """`held_prefix(block_ids)`: how many of the leading blocks the CPU tier holds, each in
        its place in the chain (the node agent's block set). A moved handle is offered until
        `ttl_s` after its publish, or as long as the device handle was, if longer."""
        self.p2p_host, self.p2p_port = p2p_endpoint
        self.ttl_ms = int(ttl_s * 1000)
        self._clock_unix_ms = clock_unix_ms
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._held_prefix = held_prefix
        self._tracked: dict[str, _Tracked] = {}
        # Moves sent, awaiting the control plane: request id -> the GPU blocks they will free,
        # the HOST-tier handle sent.
        self._moving: dict[str, tuple[int, CacheHandle]] = {}
        # Moved: request id -> (the host handle, its first block).
        self._moved: dict[str, tuple[CacheHandle, int]] = {}
        self._lock = threading.Lock()
        self._outcomes: list[tuple[str, bool]] = []
        # The leader's order of moves (request ids, least valuable first); replaced whole by the
        # agent's thread. Its host half is not used: vLLM's LRU, not kvplane, drops CPU blocks.
        self._order: tuple[str, ...] = ()

    def set_order(self, device: Sequence[str], host: Sequence[str]) -> None:
        """The control plane's spill order (`SpillOrder`). Any thread."""
        self._order = tuple(device)

    # -- the scheduler thread ------------------------------------------------------------------

    def track(
        self, request_id: str, handle: CacheHandle, token_ids: Sequence[int], block_hashes: Sequence[bytes]
    ) -> None:
        """At publish: the handle, the tokens its blocks hold, vLLM's hashes of the request's blocks.
        The tokens are kept as given, not copied (vLLM keeps a held request's as they are)."""
        whole = min(len(token_ids) // self.block_size, len(block_hashes))
        ids = tuple(external_id(h) for h in block_hashes[:whole])
        self._tracked[request_id] = _Tracked(
            handle, ids, token_ids, handle.vllm.num_blocks, self._clock_unix_ms()
        )

    def forget(self, request_id: str) -> None:
        """Its blocks were freed (read, expired, released) before any move: nothing to move."""
        self._tracked.pop(request_id, None)
        self._moving.pop(request_id, None)

    def spill(self, blocks_wanted: int) -> list[tuple[str, CacheHandle]]:
        """Moves for at least `blocks_wanted` GPU blocks, in the spill order, each only for the
        prefix the CPU tier holds: (request id, the HOST-tier handle to publish). Fewer, or
        none, when the CPU tier holds too little."""
        out: list[tuple[str, CacheHandle]] = []
        freed = 0
        named = [i for i in self._order if i in self._tracked]
        taken = set(named)
        for request_id in named + [i for i in self._tracked if i not in taken]:
            if freed >= blocks_wanted:
                break
            moved = self.move(request_id)
            if moved is not None:
                freed += self._tracked[request_id].gpu_blocks
                out.append((request_id, moved))
        return out

    def move(self, request_id: str) -> CacheHandle | None:
        """The move of one tracked handle not already moving, for the prefix the CPU tier
        holds: the HOST-tier handle to publish, or None (nothing to move)."""
        tracked = self._tracked.get(request_id)
        if tracked is None or request_id in self._moving:
            return None
        moved = self._moved_handle(tracked)
        if moved is not None:
            self._moving[request_id] = (tracked.gpu_blocks, moved)
        return moved

    def moving_blocks(self) -> int:
        """GPU blocks of the moves in flight: free once they are stored."""
        return sum(blocks for blocks, _ in self._moving.values())

    def settled(self) -> tuple[list[str], list[str]]:
        """The moves the control plane answered since the last call: (stored: free their GPU
        blocks now, without a release report; refused: the device handle stays as it is)."""
        with self._lock:
            outcomes, self._outcomes = self._outcomes, []
        stored: list[str] = []
        refused: list[str] = []
        for request_id, ok in outcomes:
            moving = self._moving.pop(request_id, None)
            if moving is None:
                continue  # its blocks were freed meanwhile (read, expired, released)
            if not ok:
                # Checked out, released or superseded: whatever got there first frees it, and
                # it is never tried again.
                self._tracked.pop(request_id, None)
                refused.append(request_id)
                continue
            tracked = self._tracked.pop(request_id)
            self._moved[request_id] = (moving[1], tracked.block_ids[0])
            stored.append(request_id)
        return stored, refused

    def is_moved(self, request_id: str) -> bool:
        return request_id in self._moved

    def release(self, request_id: str) -> bool:
        """A release command: True when it names a moved handle, which ends now."""
        return self._moved.pop(request_id, None) is not None

    def ended(self, now_unix_ms: int) -> list[str]:
        """Moved handles whose first block the CPU tier dropped, or past their expiry: ended now."""
        gone = [
            request_id
            for request_id, (handle, first) in self._moved.items()
            if handle.wall_expiry_unix_ms <= now_unix_ms or self._held_prefix((first,)) == 0
        ]
        for request_id in gone:
            del self._moved[request_id]
        return gone

    def moved_request_ids(self) -> Iterable[str]:
        return tuple(self._moved)

    def __len__(self) -> int:
        """Handles moved and not yet ended."""
        return len(self._moved)

    # -- the agent's thread --------------------------------------------------------------------

    def refuses_move(self, request_id: str) -> str:
        """Why a MoveCommand for `request_id` cannot be carried out ("" when it can, or when
        the handle is not on the GPU any more). Reads the tracked handles one key at a time."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return ""
        if self._held_prefix(tracked.block_ids[:1]) == 0:
            return f"the CPU tier holds no block of {request_id}"
        return ""

    def outcome(self, request_id: str) -> Callable[[bool], None]:
        """The callback for a move's publish: queues its outcome for `settled`."""

        def told(stored: bool) -> None:
            with self._lock:
                self._outcomes.append((request_id, stored))

        return told

    # -- internals -----------------------------------------------------------------------------

    def _moved_handle(self, tracked: _Tracked) -> CacheHandle | None:
        """The HOST-tier handle for the prefix of `tracked` the CPU tier holds, or None."""
        blocks = self._held_prefix(tracked.block_ids)
        if blocks <= 0:
            return None
        was = tracked.handle
        digests = token_digests.digest_tokens(tracked.token_ids[: blocks * self.block_size], self.block_size)
        extra = dict(was.vllm.extra)
        extra[KEY_REMOTE_KV_SOURCE] = {"remote_host": self.p2p_host, "remote_port": self.p2p_port}
        # Host memory keeps it longer than the GPU would: both clocks move by as much.
        longer_ms = max(0, tracked.tracked_unix_ms + self.ttl_ms - was.wall_expiry_unix_ms)
        expiry = was.vllm.remote_blocks_expiry_time
        return dataclasses.replace(
            was,
            handle_id=uuid.uuid4().hex,
            # No block of the engine's KV cache: P reads the copies by hash, through vLLM's P2P.
            vllm=dataclasses.replace(
                was.vllm,
                remote_block_ids=(),
                remote_num_tokens=blocks * self.block_size,
                extra=extra,
                remote_blocks_expiry_time=None if expiry is None else expiry + longer_ms / 1000,
            ),
            wall_expiry_unix_ms=was.wall_expiry_unix_ms + longer_ms,
            retained_bytes=blocks * self.bytes_per_block,
            digests=digests,
            tier=KvTier.HOST,
            relocates_handle_id=was.handle_id,
        )


def parse_endpoint(text: str) -> tuple[str, int]:
    """host:port (an IPv6 host in brackets) of the engine's offloading P2P tier."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"host_tier_p2p must be host:port, not {text!r}")
    return host, int(port)
