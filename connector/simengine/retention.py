"""Retention: the blocks a finished request keeps for a remote reader, and every way they are freed.

As vLLM's NixlConnector does (PROTOCOL.md):

- a D leg that finishes naturally, with bidirectional transfer on, keeps its blocks as a handle
  (``decode_handle``) for ``decoder_kv_blocks_ttl``; a draining engine keeps none;
- a P leg keeps its blocks as a lease (``prefill_lease``) for ``prefill_lease_s``, for D's read.

Either is freed by its reader's NIXL notification (``read``), its deadline (``ttl``), a release
command (``early``) or a drain (``drain``). Held blocks carry a lease stamp of (engine id,
incarnation, request id), so a reader can tell blocks leased to its handle from any others. The
observer hears of every D handle kept, moved and freed.

With a host tier (``host_kv_blocks``), a request short of cache blocks does not wait for the
control plane first: ``spill`` moves D handles to host blocks (after the modelled copy time) and
tells the observer the handle's new blocks, which the connector publishes as a relocation of the
handle. Same request id, same stamp: a reader of the new blocks checks them as it would the old
ones. The cache blocks are freed only once the control plane has stored the relocation (the
observer's ``settle``), as the vLLM connector frees GPU blocks: until then a turn may still check
the old handle out and read them. A relocation it refuses (the handle was checked out, released
or superseded first) gives the host blocks back and leaves the cache blocks to whatever got
there first; that handle never moves again. An answer that has not come within
``relocation_wait_s`` (the control plane unreachable, or slow) no longer holds D's memory: the
handle moves anyway, and a turn that checked it out meanwhile fails the old blocks' check and
recomputes; refused later, the moved handle is freed, since nobody can find it there. A moved
handle is offered until
``host_kv_ttl_s`` after its turn ended (D's TTL, if longer). A host tier that is full frees
handles there (``host_full``) to make room. Both go in the control plane's value order, least
expected reuse per byte first, as its leader last sent it (``set_spill_order``); the handles the
order leaves out follow, oldest first.

The control plane also moves a handle there when its policies want the handle's cache blocks
back (``move_to_host``, a MoveCommand): the same copy, in place of a release.

With ``host_copy_ahead`` (the default), D copies each handle to the host tier as it keeps it, off
every request's path, as vLLM's OffloadingConnector stores blocks as they fill: the handle stays
in the KV cache, read from there, and a move only switches it to its copy and frees the cache
blocks at once, where without the copy a request short of blocks waits for it. A copy ahead takes
host blocks as a move does, making room by freeing the host tier's handles in the spill order, as
vLLM's CPU tier evicts older blocks to store new ones, and only then by giving back older copies
ahead (their handles are still in the KV cache; giving them back first would leave the next moves
to wait for whole copies). A handle freed from the KV cache gives its copy back.

Event-loop thread only, except ``release_early``, ``move_to_host``, ``drain``, ``freeing_blocks``,
``handle_ids`` and ``set_spill_order``, which the node agent calls from its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvplane.connector.simengine.block_content import lease_stamp
from kvplane.connector.simengine.block_pool import BlockPool
from kvplane.connector.simengine.engine_hooks import EngineObserver, NullObserver
from kvplane.connector.simengine.kv_params import holder_params
from kvplane.connector.simengine.metrics import SimEngineMetrics
from kvplane.connector.simengine.nixl_transport import NixlTransport
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.services.common.model.handles import KEY_PULL_MS, KEY_PULLED_TOKENS, KEY_QUEUED_MS

log = logging.getLogger(__name__)

RetainKind = Literal["decode_handle", "prefill_lease"]
Tier = Literal["device", "host"]
_RECENTLY_FREED_MAX = 4096
# How often the notification loop polls NIXL, which is what lets a reader's READ of this engine's
# blocks progress (the agent has no progress thread): briskly while a prefill lease waits for its
# decode engine's READ, which comes within milliseconds; less so while only handles for later
# turns are held; and while nothing is held, not until something is (or this long has passed).
POLL_LEASED_S = 0.001
POLL_HOLDING_S = 0.005
POLL_IDLE_S = 0.05


class Holder(Protocol):
    """The engine that holds the blocks, as its params name it."""

    engine_id: str
    # New at every start; the node agent's, once it registers (part of every lease stamp).
    incarnation: str

    @property
    def side_channel_port(self) -> int: ...


@dataclass
class _Retained:
    request_id: str
    kind: RetainKind
    block_ids: list[int]
    num_tokens: int
    stamp: int
    expiry: float  # perf_counter
    nbytes: int
    tier: Tier = "device"
    # Host blocks holding a whole copy of a handle still in the KV cache (`host_copy_ahead`).
    copy: list[int] | None = None
    # Host blocks published as its new place, while the control plane has not answered yet.
    moving_to: list[int] | None = None
    # Its relocation was refused: whoever checked it out or released it frees it; never moved.
    stays: bool = False


class Retention:
    """The blocks one engine holds for remote readers."""

    def __init__(
        self, settings: SimEngineSettings, pool: BlockPool, metrics: SimEngineMetrics, holder: Holder
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.holder = holder
        self.observer: EngineObserver = NullObserver()
        # Set whenever blocks return to the pool: requests waiting for KV memory try again.
        self.blocks_freed = asyncio.Event()
        self._retained: dict[str, _Retained] = {}
        # The prefill leases among them, and a wake-up for the notification loop when one is kept.
        self._leases: set[str] = set()
        self._kept = asyncio.Event()
        self._retained_bytes = 0  # in the KV cache
        self._host_bytes = 0
        # Handles being copied to the host tier, and their cache blocks (event-loop thread; the
        # agent's thread reads the count, one int).
        self._spilling: dict[str, asyncio.Task[None]] = {}
        self._spilling_blocks = 0
        # Cache blocks of handles whose relocation the control plane has not answered yet (the
        # event-loop thread writes it; the agent's thread reads one int).
        self._settling_blocks = 0
        # Copies ahead under way, and the handles whose copy is whole, oldest first (event-loop
        # thread).
        self._copying: dict[str, asyncio.Task[None]] = {}
        self._copied: OrderedDict[str, None] = OrderedDict()
        # Whether short requests move handles to the host tier (the engine's /sim/host_tier).
        self.host_tier_enabled = True
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recently_freed: OrderedDict[str, str] = OrderedDict()
        # Release commands taken and not yet carried out: request id -> blocks. Written from
        # the node agent's thread too, hence the lock.
        self._freeing: dict[str, int] = {}
        self._freeing_lock = threading.Lock()
        # The leader's order of moves to the host tier and of drops there (request ids, least
        # valuable first); replaced whole, so any thread may set it.
        self._spill_order: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The engine's event loop, where commands from other threads are carried out."""
        self._loop = loop

    @property
    def retained_bytes(self) -> int:
        """Bytes of the KV cache held (the host tier's are `host_bytes`)."""
        return self._retained_bytes

    @property
    def host_bytes(self) -> int:
        return self._host_bytes

    @property
    def spilling_blocks(self) -> int:
        """Cache blocks of handles being moved to the host tier: free once the copies end and the
        control plane stores the relocations. Any thread."""
        return self._spilling_blocks + self._settling_blocks

    @property
    def count(self) -> int:
        """Handles and leases held."""
        return len(self._retained)

    # -- keeping -----------------------------------------------------------

    def keep(
        self,
        request_id: str,
        kind: RetainKind | None,
        blocks: list[int],
        num_tokens: int,
        all_tokens: Sequence[int],
        pulled_tokens: int,
        request_params: Mapping[str, Any],
        *,
        pull_ms: float = 0.0,
        queued_ms: float = -1.0,
    ) -> dict[str, Any] | None:
        """A finished request's blocks (KV for its first `num_tokens` tokens): kept as `kind`,
        returning the params a reader needs, or back to the pool (`kind` None, or a draining
        engine's D handle), returning None. `pull_ms`: how long P's pull of `pulled_tokens` took;
        `queued_ms`: how long the prompt waited for P's compute besides (negative: unknown)."""
        s, h = self.settings, self.holder
        if kind == "decode_handle" and self._draining:
            kind = None  # a draining engine keeps nothing for later turns
        if kind is None or not blocks:
            if blocks:
                self.pool.release(blocks)
                self.blocks_freed.set()
            return None
        stamp = lease_stamp(h.engine_id, h.incarnation, request_id)
        # Copies of shared blocks may use the pool down to a tenth free, no further.
        lease = self.pool.lease(blocks, stamp, reserve_blocks=self.pool.num_blocks // 10)
        blocks = lease.block_ids
        self.metrics.shared_blocks(lease.copied, lease.restamped)
        ttl = s.decoder_kv_blocks_ttl if kind == "decode_handle" else s.prefill_lease_s
        expiry = time.perf_counter() + ttl
        r = _Retained(request_id, kind, blocks, num_tokens, stamp, expiry, len(blocks) * s.bytes_per_block)
        self._retained[request_id] = r
        self._retained_bytes += r.nbytes
        if kind == "prefill_lease":
            self._leases.add(request_id)
        self._kept.set()
        params = self._params(r)
        if kind == "prefill_lease":
            # What was pulled, as the engine saw it: the gateway counts it apart from cache hits.
            params[KEY_PULLED_TOKENS] = pulled_tokens
            if pulled_tokens:
                params[KEY_PULL_MS] = round(pull_ms, 3)
            if queued_ms >= 0:
                params[KEY_QUEUED_MS] = round(queued_ms, 3)
        else:
            try:
                self.observer.on_handle_retained(params, all_tokens, r.nbytes, request_params)
            except Exception:
                log.exception("observer failed in on_handle_retained")
            self._copy_ahead(r)
        return params

    def _params(
        self, r: _Retained, block_ids: list[int] | None = None, expiry: float | None = None
    ) -> dict[str, Any]:
        """What a reader of `r`'s blocks needs, where they are now (or at `block_ids`, until `expiry`)."""
        h = self.holder
        return holder_params(
            as_decode_handle=r.kind == "decode_handle",
            engine_id=h.engine_id,
            incarnation=h.incarnation,
            request_id=r.request_id,
            block_ids=r.block_ids if block_ids is None else block_ids,
            host=self.settings.advertised_side_channel_host,
            port=h.side_channel_port,
            num_tokens=r.num_tokens,
            expiry_time=r.expiry if expiry is None else expiry,
        )

    # -- the control-plane seam (EngineControl) ---------------------------

    def release_early(self, request_id: str) -> bool:
        held = self._retained.get(request_id)
        # Blocks being copied to the host tier already count as on their way (`spilling_blocks`).
        if held is not None and held.tier == "device" and not self._moving(held):
            # Counted as on its way before the command is acknowledged: a demand report sent
            # after the ack must not ask for these blocks again.
            with self._freeing_lock:
                self._freeing[request_id] = len(held.block_ids)
        self._on_loop(self._release_if_held, request_id)
        return held is not None

    def set_spill_order(self, device: Sequence[str], host: Sequence[str]) -> None:
        """The control plane's order of moves to the host tier (device request ids) and of drops
        there (host request ids), least valuable first. Any thread."""
        self._spill_order = (tuple(device), tuple(host))

    def spill_order(self) -> dict[str, list[str]]:
        """The last order the control plane sent (request ids by tier), for the engine's state."""
        device, host = self._spill_order
        return {"device": list(device), "host": list(host)}

    def _in_spill_order(self, tier: Tier) -> list[_Retained]:
        """The handles of `tier`: those the spill order names, in its order, then the rest
        oldest first."""
        named = self._spill_order[0 if tier == "device" else 1]
        first = [r for i in named if (r := self._retained.get(i)) is not None and r.tier == tier]
        taken = {r.request_id for r in first}
        return first + [r for r in self._retained.values() if r.tier == tier and r.request_id not in taken]

    def drain(self) -> None:
        self._draining = True
        self._on_loop(self._release_all)

    def freeing_blocks(self) -> int:
        """Blocks of release commands taken and not yet carried out. Any thread."""
        with self._freeing_lock:
            return sum(self._freeing.values())

    def handle_ids(self) -> list[str]:
        """Request ids of the decode handles held; from any thread (the values are copied in one step)."""
        return [r.request_id for r in list(self._retained.values()) if r.kind == "decode_handle"]

    def describe(self) -> list[dict[str, Any]]:
        now = time.perf_counter()
        return [
            {
                "request_id": r.request_id,
                "kind": r.kind,
                "num_tokens": r.num_tokens,
                "num_blocks": len(r.block_ids),
                "bytes": r.nbytes,
                "expires_in_s": r.expiry - now,
                "tier": r.tier,
                "host_copy": r.copy is not None,
                "moving_to_host": r.moving_to is not None,
            }
            for r in self._retained.values()
        ]

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn now when on the engine's loop, else schedule it there (the agent has its own thread)."""
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is self._loop or self._loop is None:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _release_if_held(self, request_id: str) -> None:
        if request_id in self._retained:
            self._free(request_id, "early")
        with self._freeing_lock:
            self._freeing.pop(request_id, None)

    def _release_all(self) -> None:
        for request_id in list(self._retained):
            self._free(request_id, "drain")

    # -- the host tier --------------------------------------------------------

    def spill(self, blocks: int) -> int:
        """Start moving D handles to the host tier, in the spill order, until `blocks` cache
        blocks are on their way back (those already moving count); returns how many are.
        Event-loop thread, inside the engine's loop."""
        if not self._can_spill():
            return 0
        planned = self.spilling_blocks
        for r in self._in_spill_order("device"):
            if planned >= blocks:
                break
            if self._start_spill(r):
                planned += len(r.block_ids)
        return planned

    def move_to_host(self, request_id: str) -> str:
        """The control plane's MoveCommand: start moving this handle to the host tier. "" when
        the move started or the handle is not in the KV cache any more (read, freed, moved);
        else why it cannot move. Any thread: the move starts on the engine's loop."""
        held = self._retained.get(request_id)
        if not self._can_spill():
            return "the host tier is off or the engine is draining"
        if held is None or held.tier != "device" or self._moving(held) or held.stays:
            return ""
        if held.kind != "decode_handle" or len(held.block_ids) > self.pool.host_blocks:
            return f"{request_id} cannot move to a host tier of {self.pool.host_blocks} blocks"
        with self._freeing_lock:
            # On their way from now on, for demand reports sent before the copy starts.
            self._freeing[request_id] = len(held.block_ids)
        self._on_loop(self._move_if_held, request_id)
        return ""

    def _move_if_held(self, request_id: str) -> None:
        held = self._retained.get(request_id)
        if held is not None and self._can_spill():
            self._start_spill(held)
        with self._freeing_lock:
            self._freeing.pop(request_id, None)

    def _can_spill(self) -> bool:
        return self.pool.host_blocks > 0 and not self._draining and self.host_tier_enabled

    def _moving(self, r: _Retained) -> bool:
        """Whether `r` is on its way to the host tier: being copied, or its relocation unanswered."""
        return r.request_id in self._spilling or r.moving_to is not None

    def _start_spill(self, r: _Retained) -> bool:
        """Starts moving `r` to the host tier, if it is a D handle in the KV cache not already
        on its way there, nor refused a move, that the tier can hold; True if it did (a handle
        with a whole copy ahead is relocated at once). Event-loop thread."""
        if r.kind != "decode_handle" or r.tier != "device" or self._moving(r) or r.stays:
            return False
        if len(r.block_ids) > self.pool.host_blocks:
            return False
        if r.copy is not None:
            self._relocate_to_copy(r)
            return True
        self._spilling_blocks += len(r.block_ids)
        self._spilling[r.request_id] = asyncio.get_running_loop().create_task(self._spill(r))
        return True

    async def _spill(self, r: _Retained) -> None:
        count = len(r.block_ids)
        try:
            ahead = self._copying.get(r.request_id)
            if ahead is not None:
                # Its copy ahead is under way: the move waits for it rather than copy twice.
                await asyncio.wait({ahead})
            if r.copy is not None:
                self._relocate_to_copy(r)
                return
            host = await self._copy_to_host(r)
            if host is None:
                self.metrics.spill("no_room")
                return
            self._relocate(r, host)
        except asyncio.CancelledError:
            # Read, released or expired while it (or its copy ahead) was being copied (`_free`):
            # nothing to move.
            self.metrics.spill("freed_first")
        finally:
            self._spilling.pop(r.request_id, None)
            self._spilling_blocks -= count

    async def _copy_to_host(self, r: _Retained) -> list[int] | None:
        """Host blocks holding a whole copy of `r`'s cache blocks, after the modelled copy time
        (the handle stays readable where it is meanwhile); None: no room could be made.
        Cancelled (`_free`), it gives the host blocks back."""
        host = self._host_room(len(r.block_ids))
        if host is None:
            return None
        try:
            await asyncio.sleep(r.nbytes / self.settings.host_copy_bytes_per_s)
        except asyncio.CancelledError:
            self.pool.host_give(host)
            raise
        self.pool.host_copy(r.block_ids, host)
        return host

    def _relocate_to_copy(self, r: _Retained) -> None:
        """`r` moves to its whole copy ahead, at once."""
        assert r.copy is not None
        self._copied.pop(r.request_id, None)
        copied, r.copy = r.copy, None
        self._relocate(r, copied)

    def _relocate(self, r: _Retained, host: list[int]) -> None:
        """`r` is proposed to live in `host`, a whole copy of its cache blocks: the observer hears
        of the handle's new blocks, and `_settle` carries out the control plane's answer. Its
        cache blocks count as on their way meanwhile. Event-loop thread."""
        r.moving_to = host
        self._settling_blocks += len(r.block_ids)
        params = self._params(r, host, self._host_expiry(r))

        def settle(stored: bool) -> None:
            # Any thread, once: the observer's answer for this relocation.
            self._on_loop(self._settle, r, host, stored)

        try:
            self.observer.on_handle_moved(r.request_id, params, settle)
        except Exception:
            log.exception("observer failed in on_handle_moved")
            self._settle(r, host, False)
        if r.moving_to is host:
            asyncio.get_running_loop().call_later(self.settings.relocation_wait_s, self._unanswered, r, host)

    def _host_expiry(self, r: _Retained) -> float:
        """`r`'s expiry once in host memory: offered longer there than D's TTL holds cache blocks
        (`host_kv_ttl_s`), never shorter."""
        s = self.settings
        return max(r.expiry, r.expiry - s.decoder_kv_blocks_ttl + s.host_kv_ttl_s)

    def _settle(self, r: _Retained, host: list[int], stored: bool) -> None:
        """The control plane stored `r`'s relocation to `host` (its cache blocks are freed, it
        lives in `host` from now on) or refused it (`host` is given back; it stays where it is,
        for whoever got there first, and never moves again). Event-loop thread."""
        if self._retained.get(r.request_id) is not r:
            return  # freed meanwhile (`_free` gave `host` back)
        if r.block_ids is host:
            # Moved already, the wait having run out (the answer comes once): a refused move is
            # in no tier anyone can see.
            if not stored:
                self._free(r.request_id, "refused")
            return
        if r.moving_to is not host:
            return  # answered already
        r.moving_to = None
        self._settling_blocks -= len(r.block_ids)
        if not stored:
            r.stays = True
            self.pool.host_give(host)
            self.metrics.spill("refused")
            return
        self._switch(r, host)
        self.metrics.spill("moved")

    def _unanswered(self, r: _Retained, host: list[int]) -> None:
        """`relocation_wait_s` after `r`'s relocation was published: if still unanswered, `r`
        moves to `host` anyway and its cache blocks are freed. Event-loop thread."""
        if self._retained.get(r.request_id) is not r or r.moving_to is not host:
            return
        r.moving_to = None
        self._settling_blocks -= len(r.block_ids)
        self._switch(r, host)
        self.metrics.spill("moved_unanswered")

    def _switch(self, r: _Retained, host: list[int]) -> None:
        """`r` lives in `host` from now on; its cache blocks are freed. Event-loop thread."""
        device, r.block_ids, r.tier = r.block_ids, host, "host"
        r.expiry = self._host_expiry(r)
        self._retained_bytes -= r.nbytes
        self._host_bytes += r.nbytes
        self.pool.unlease(device, r.stamp)
        self.pool.release(device)
        self.blocks_freed.set()

    def _copy_ahead(self, r: _Retained) -> None:
        """Starts copying a handle just kept to the host tier, where `host_copy_ahead` is on and
        the tier can hold it. Event-loop thread."""
        if not self.settings.host_copy_ahead or not self._can_spill():
            return
        if len(r.block_ids) > self.pool.host_blocks:
            return
        self._copying[r.request_id] = asyncio.get_running_loop().create_task(self._copy(r))

    async def _copy(self, r: _Retained) -> None:
        try:
            host = await self._copy_to_host(r)
            if host is None:
                self.metrics.spill("no_room_ahead")
                return
            if r.tier != "device" or self._retained.get(r.request_id) is not r:
                self.pool.host_give(host)  # moved or freed meanwhile
                return
            r.copy = host
            self._copied[r.request_id] = None
            self.metrics.spill("copied_ahead")
        finally:
            self._copying.pop(r.request_id, None)

    def _drop_copy(self, request_id: str) -> None:
        """Gives back the host blocks of a handle's copy ahead (the handle stays in the KV cache)."""
        self._copied.pop(request_id, None)
        r = self._retained.get(request_id)
        if r is not None and r.copy is not None:
            self.pool.host_give(r.copy)
            r.copy = None

    async def stop_spills(self) -> None:
        """Stop the copies to the host tier in progress (the engine is stopping)."""
        copies = [*self._spilling.values(), *self._copying.values()]
        for task in copies:
            task.cancel()
        await asyncio.gather(*copies, return_exceptions=True)

    def _host_room(self, count: int) -> list[int] | None:
        """`count` host blocks, freeing the host tier's handles in the spill order as needed,
        then giving back older copies ahead (their handles are still in the KV cache); None: it
        cannot hold that many even empty."""
        while True:
            taken = self.pool.host_take(count)
            if taken is not None:
                return taken
            first = next(iter(self._in_spill_order("host")), None)
            if first is not None:
                self._free(first.request_id, "host_full")
                continue
            oldest = next(iter(self._copied), None)
            if oldest is None:
                return None
            self._drop_copy(oldest)

    # -- freeing ------------------------------------------------------------

    def _free(self, request_id: str, reason: str) -> None:
        r = self._retained.pop(request_id)
        self._leases.discard(request_id)
        for tasks in (self._spilling, self._copying):
            copying = tasks.get(request_id)
            if copying is not None:
                copying.cancel()  # its copy to the host tier ends with nothing moved
        if r.copy is not None:
            self._copied.pop(request_id, None)
            self.pool.host_give(r.copy)
            r.copy = None
        if r.moving_to is not None:
            # Its relocation is unanswered: the answer, when it comes, finds nothing to do.
            self.pool.host_give(r.moving_to)
            self._settling_blocks -= len(r.block_ids)
            r.moving_to = None
        if r.tier == "host":
            self._host_bytes -= r.nbytes
            self.pool.host_give(r.block_ids)
            if reason == "read":
                self.metrics.host_read()
        else:
            self._retained_bytes -= r.nbytes
            self.pool.unlease(r.block_ids, r.stamp)
            self.pool.release(r.block_ids)
        self._recently_freed[request_id] = reason
        while len(self._recently_freed) > _RECENTLY_FREED_MAX:
            self._recently_freed.popitem(last=False)
        self.metrics.freed(r.kind, reason)
        self.blocks_freed.set()
        if r.kind == "decode_handle":
            try:
                self.observer.on_blocks_freed(request_id, reason == "read")
            except Exception:
                log.exception("observer failed in on_blocks_freed")

    def _on_notification(self, msg: bytes) -> None:
        try:
            request_id = json.loads(msg)["request_id"]
        except (ValueError, KeyError, TypeError):
            self.metrics.unmatched_notif("malformed")
            return
        if not isinstance(request_id, str):
            self.metrics.unmatched_notif("malformed")
        elif request_id in self._retained:
            self._free(request_id, "read")
        elif request_id in self._recently_freed:
            # A second read of a consumed or expired handle: the reader got unleased blocks.
            self.metrics.unmatched_notif(f"after_{self._recently_freed[request_id]}")
        else:
            self.metrics.unmatched_notif("unknown")

    async def notification_loop(self, transport: NixlTransport) -> None:
        """Frees what readers report read, until cancelled."""
        while True:
            try:
                for _agent, msg in transport.poll_notifs():
                    self._on_notification(msg)
            except Exception:
                # A lost poll must not stop every later free: log and keep polling.
                log.exception("polling NIXL notifications failed")
            await self._next_poll()

    def poll_interval(self) -> float | None:
        """Seconds until the notification loop polls NIXL again; None while nothing is held (it
        then polls as soon as something is kept, or after POLL_IDLE_S)."""
        if self._leases:
            return POLL_LEASED_S
        return POLL_HOLDING_S if self._retained else None

    async def _next_poll(self) -> None:
        interval = self.poll_interval()
        if interval is not None:
            await asyncio.sleep(interval)
            return
        # Not a plain sleep: a READ of blocks kept meanwhile would wait for the rest of it.
        self._kept.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(POLL_IDLE_S):
                await self._kept.wait()

    async def reaper_loop(self) -> None:
        """Frees what reached its deadline unread, until cancelled."""
        while True:
            now = time.perf_counter()
            for r in [r for r in self._retained.values() if r.expiry <= now]:
                try:
                    self._free(r.request_id, "ttl")
                    self.metrics.expired()
                except Exception:
                    log.exception("freeing expired %s failed", r.request_id)
                    self._retained.pop(r.request_id, None)
                    self._leases.discard(r.request_id)
            nxt = min((r.expiry for r in self._retained.values()), default=now + 0.1)
            await asyncio.sleep(min(max(nxt - time.perf_counter(), 0.001), 0.1))
