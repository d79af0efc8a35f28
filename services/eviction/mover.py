"""Moves instead of releases, for nodes with a host tier.

When the leader's policies free a handle's KV-cache blocks (its age nears D's TTL, its expected
reuse is below what its blocks cost, its node or tenant needs the memory), a node whose engine has
a host tier can keep the handle there instead: host memory is large and cheap, and a later turn
reads it from there as it would from the KV cache. So for such a node (its hello accepts moves)
the leader sends a `MoveCommand` in place of the release.

A move changes no etcd record: the handle stays retained and routable where it is until the
engine's copy lands and it publishes the handle's relocation, as it does for the moves it makes
itself when short of blocks. So a move is neither stored nor replayed, and costs etcd nothing;
until the node answers, the handle is not judged again and its bytes count as freed against the
node's demand (`Releaser.note_sent`), as a release's do.

An engine that cannot move the handle (no host tier, too little of one, draining) refuses the
command; that handle is then released at the next round, and never offered as a move again. The
decision to take its blocks back stands: the release is owed, not judged afresh (a budget's
policy that freed the node down to its low mark would not, judging again between its marks,
release the handles whose moves came to nothing). A
move the node never acknowledged (its stream closed) is forgotten, and decided afresh; one it
started whose handle is still in the KV cache `eviction.move_settle_s` later is released. While the
stream of a node that takes moves is down, its handles wait for it, routable where they are: a
release would reach the engine no sooner, and would throw the history away. So do the handles of
any node whose stream has not opened yet in the first `eviction.move_grace_s` of a term: a new
leader learns which nodes take moves only as they reconnect.

Releases that end a handle for good are never moves: a drain, an explicit release, a newer turn.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvplane.services.common.model.handles import KvTier, ReleaseReason
from kvplane.services.common.store import now_ms
from kvplane.services.common.store.cluster_view import ClusterView
from kvplane.services.eviction.metrics import EvictionMetrics
from kvplane.services.eviction.policy import Release
from kvplane.services.eviction.releaser import Releaser
from kvplane.services.eviction.sessions import SessionRegistry

log = logging.getLogger(__name__)

# The policies' reasons to take a handle's blocks out of the KV cache, which a move answers.
MOVABLE = frozenset(
    {ReleaseReason.MAX_AGE, ReleaseReason.LOW_VALUE, ReleaseReason.NODE_BUDGET, ReleaseReason.TENANT_BUDGET}
)
# Handles whose move a node refused, remembered so they are released, not offered again.
_REFUSED_MAX = 4096


class Mover:
    def __init__(
        self,
        view: ClusterView,
        sessions: SessionRegistry,
        releaser: Releaser,
        metrics: EvictionMetrics,
        wake: Callable[[], None],
        grace_s: float = 0.0,
        settle_s: float = 30.0,
    ) -> None:
        self.view = view
        self.sessions = sessions
        self.releaser = releaser
        self.metrics = metrics
        self._wake = wake
        # Moves sent and not yet answered: command id -> the release it stands for.
        self._moving: dict[str, Release] = {}
        # Moves sent in this leader's life (a demand round tells from it whether it moved any).
        self.sent = 0
        # Moves the node started, until their relocation shows: command id -> (release, when
        # started, time.monotonic()). One still not relocated `settle_s` later is taken back.
        self._started: dict[str, tuple[Release, float]] = {}
        self.settle_s = settle_s
        self._refused: OrderedDict[str, None] = OrderedDict()
        # Releases owed for moves refused or taken back, by handle id, carried out at the next round
        # (emptied every round; no bigger than the moves this leader sent).
        self._owed: dict[str, Release] = {}
        # node id -> the incarnation whose last stream took moves.
        self._movers: dict[str, str] = {}
        # Until then (time.monotonic()), a node with no stream yet may still turn out to take moves.
        self.grace_s = grace_s
        self._grace_until = 0.0

    @property
    def moving(self) -> int:
        """Moves sent and not yet answered."""
        return len(self._moving)

    def split(self, releases: Sequence[Release]) -> list[Release]:
        """Sends the moves among `releases`; returns the releases left to carry out, with those
        owed for moves that came to nothing."""
        self._settle_started()
        out = [release for release in releases if not self._moved_or_held(release)]
        if self._owed:
            owed, self._owed = self._owed, {}
            chosen = {release.handle_id for release in out}
            for handle_id, release in owed.items():
                record = self.view.handle(release.tenant, release.conversation)
                if (
                    handle_id not in chosen
                    and record is not None
                    and record.handle.handle_id == handle_id
                    and record.handle.tier is KvTier.DEVICE
                ):
                    out.append(release)
        return out

    def start_term(self) -> None:
        """A term starts: nodes whose streams were open to another leader reconnect to this one."""
        self._grace_until = time.monotonic() + self.grace_s

    def note_session(self, node_id: str, incarnation: str, accepts_moves: bool) -> None:
        """A node's stream opened: whether this life of the node takes moves."""
        if accepts_moves:
            self._movers[node_id] = incarnation
        else:
            self._movers.pop(node_id, None)

    def _moved_or_held(self, release: Release) -> bool:
        """True when `release` went out as a move, or waits for the node's stream to come back
        (a node that takes moves, away for a moment: the next round decides again)."""
        if release.reason not in MOVABLE or release.handle_id in self._refused:
            return False
        record = self.view.handle(release.tenant, release.conversation)
        if record is None or record.handle.handle_id != release.handle_id:
            return False  # gone or superseded: the release finds that out and drops the decision
        handle = record.handle
        session = self.sessions.get(release.node_id)
        if self._movers.get(release.node_id) != handle.holder_incarnation:
            # Not known to take moves; after a failover, it may just not have reconnected yet.
            return session is None and time.monotonic() < self._grace_until
        if session is None or session.closed or session.incarnation != handle.holder_incarnation:
            return True
        command_id = f"move-{uuid.uuid4().hex}"
        if not session.offer_move(command_id, release, handle.vllm.remote_request_id):
            return True
        self._moving[command_id] = release
        self.sent += 1
        self.releaser.note_sent(release, command_id, now_ms())
        self.metrics.moves.labels(release.reason.value, release.policy).inc()
        log.info(
            "moving handle to the host tier: %s (%s)",
            release.reason.value,
            release.detail,
            extra={
                "reason": release.reason.value,
                "policy": release.policy,
                "conversation": release.conversation,
                "handle_id": release.handle_id,
                "node": release.node_id,
                "bytes": release.retained_bytes,
                "command_id": command_id,
            },
        )
        return True

    def settled(self, command_id: str, moved: bool | None) -> None:
        """The node's answer to a move: True, it started; False, it refused (the handle is then
        released at the next round); None, the stream closed first (decided afresh)."""
        release = self._moving.pop(command_id, None)
        if release is None:
            return
        if moved:
            self._started[command_id] = (release, time.monotonic())
            return
        self._take_back(command_id, release, refused=moved is False)

    def _settle_started(self) -> None:
        """Forgets started moves whose handle was relocated or is gone; takes back, as refused,
        those whose handle is still in the KV cache `settle_s` after the node started the move
        (its copy came to nothing: the CPU tier dropped the blocks meanwhile, say)."""
        now = time.monotonic()
        for command_id, (release, started) in list(self._started.items()):
            record = self.view.handle(release.tenant, release.conversation)
            if (
                record is None
                or record.handle.handle_id != release.handle_id
                or record.handle.tier is not KvTier.DEVICE
            ):
                del self._started[command_id]
            elif now - started >= self.settle_s:
                del self._started[command_id]
                self._take_back(command_id, release, refused=True)

    def _take_back(self, command_id: str, release: Release, refused: bool) -> None:
        self.releaser.take_back(release, command_id)
        if refused:
            self._refused[release.handle_id] = None
            self._owed[release.handle_id] = release
            while len(self._refused) > _REFUSED_MAX:
                self._refused.popitem(last=False)
        self._wake()
