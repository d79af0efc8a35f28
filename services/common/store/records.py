"""What the stores read back from etcd: values with the revisions that fence
later changes to them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import HandleNotRetained
from kvplane.services.common.model.handles import CacheHandle, HandleState, PendingRelease
from kvplane.services.common.model.nodes import Node
from kvplane.v1 import handle_pb2


def now_ms() -> int:
    return int(time.time() * 1000)


def decode_handle(value: bytes) -> CacheHandle:
    return convert.handle_from_pb(handle_pb2.CacheHandle.FromString(value))


@dataclass(frozen=True, slots=True)
class HandleRecord:
    """A retained handle with the revision that fences changes to it."""

    handle: CacheHandle
    mod_revision: int
    lease: int


class HandleReplaced(HandleNotRetained):
    """A check-out found another handle retained for the conversation than the one it expected:
    the caller read a view that etcd had moved past (the conversation's next turn published)."""

    def __init__(self, message: str, current: HandleRecord) -> None:
        super().__init__(message)
        self.current = current


@dataclass(frozen=True, slots=True)
class HandleView:
    """What GetHandle reports: the handle and where it is in its life."""

    handle: CacheHandle
    state: HandleState


@dataclass(frozen=True, slots=True)
class PublishOutcome:
    handle: CacheHandle
    mod_revision: int
    superseded: PendingRelease | None
    # The holder had already freed these blocks (a late report): nothing was stored.
    freed: bool = False
    # A relocation whose handle is no longer the conversation's retained one: nothing was stored.
    relocation_refused: bool = False


@dataclass(frozen=True, slots=True)
class PublishHint:
    """What a watch-fed view holds for a publish: the holder's registration (None: not
    seen) and the conversation's retained handle (None: none). A publish fences on it
    instead of reading first; a stale hint only costs a second transaction."""

    node: NodeRecord | None
    handle: HandleRecord | None


@dataclass(frozen=True, slots=True)
class FreedBlocks:
    """Requests whose blocks a node's engine freed, reported with a publish of the same node
    (`PublishHandlesRequest.released_remote_request_ids`)."""

    node_id: str
    incarnation: str
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CheckOut:
    handle: CacheHandle
    claim_id: str
    revision: int
    # The handle as serialized protobuf (`kvplane.v1.CacheHandle`), encoded once for the
    # claim: a caller that answers with the handle parses these bytes instead of converting.
    handle_pb: bytes = b""


@dataclass(frozen=True, slots=True)
class NodeRecord:
    node: Node
    lease: int
    mod_revision: int


@dataclass(frozen=True, slots=True)
class ElectionRecord:
    """Who leads an election, under which lease, read at `revision`."""

    candidate: str
    lease: int
    mod_revision: int
    revision: int
