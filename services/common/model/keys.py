"""The etcd key layout, and the escaping that keeps it unforgeable.

Every variable key part is percent-encoded over UTF-8, leaving only
[A-Za-z0-9_-] as is. The encoding is injective and its output never holds
"/", so no tenant, conversation, node or request id can reach, forge or
collide with another key, and prefix ranges end at part boundaries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_SAFE_PART = re.compile(r"[A-Za-z0-9_-]+")


def escape(part: str) -> str:
    """Percent-encode one key part. Empty parts are rejected by validation first."""
    if not part:
        raise ValueError("empty key part")
    if _SAFE_PART.fullmatch(part):
        # Most ids are already in the output alphabet: nothing to encode (a check-out builds several keys).
        return part
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in part.encode("utf-8"))


def unescape(part: str) -> str:
    return bytes.fromhex("".join(_hex_runs(part))).decode("utf-8") if "%" in part else part


def _hex_runs(part: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(part):
        if part[i] == "%":
            out.append(part[i + 1 : i + 3])
            i += 3
        else:
            out.append(f"{ord(part[i]):02X}")
            i += 1
    return out


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """All keys under one prefix (default /kvplane/v1/)."""

    prefix: str = "/kvplane/v1/"

    def __post_init__(self) -> None:
        if not self.prefix.endswith("/"):
            object.__setattr__(self, "prefix", self.prefix + "/")

    def _key(self, *parts: str) -> bytes:
        return (self.prefix + "/".join(parts)).encode("utf-8")

    # nodes/{node}: the registration, bound to the node's lease.
    def nodes_prefix(self) -> bytes:
        return self._key("nodes", "")

    def node(self, node_id: str) -> bytes:
        return self._key("nodes", escape(node_id))

    # loads/{node}: the latest load report, bound to the node's lease.
    def loads_prefix(self) -> bytes:
        return self._key("loads", "")

    def load(self, node_id: str) -> bytes:
        return self._key("loads", escape(node_id))

    # node-suspects/{node}: a node that just failed a leg, under a short lease.
    # The name sorts between loads/ and nodes/, inside the range the cluster
    # view already watches.
    def suspects_prefix(self) -> bytes:
        return self._key("node-suspects", "")

    def suspect(self, node_id: str) -> bytes:
        return self._key("node-suspects", escape(node_id))

    # handles/{tenant}/{conversation}: the retained handle, bound to a lease
    # that matches its wall expiry.
    def handles_prefix(self) -> bytes:
        return self._key("handles", "")

    def tenant_handles_prefix(self, tenant: str) -> bytes:
        return self._key("handles", escape(tenant), "")

    def handle(self, tenant: str, conversation: str) -> bytes:
        return self._key("handles", escape(tenant), escape(conversation))

    def handle_parts(self, key: bytes) -> tuple[str, str]:
        tenant, conversation = key.decode("utf-8")[len(self.prefix) + len("handles/") :].split("/")
        return unescape(tenant), unescape(conversation)

    # by-node/{node}/{incarnation}/{request id}: index to the handle key,
    # written in the same transaction as the handle (so with the same
    # mod_revision) and bound to the same lease.
    def by_node_prefix(self, node_id: str, incarnation: str | None = None) -> bytes:
        if incarnation is None:
            return self._key("by-node", escape(node_id), "")
        return self._key("by-node", escape(node_id), escape(incarnation), "")

    def by_node_all_prefix(self) -> bytes:
        return self._key("by-node", "")

    def by_node(self, node_id: str, incarnation: str, request_id: str) -> bytes:
        return self._key("by-node", escape(node_id), escape(incarnation), escape(request_id))

    # freed/{node}/{incarnation}/{request}: the engine freed these blocks, or their handle left
    # retention (released, superseded, checked out); no publish may name them again (a report
    # that arrives late, or one re-sent after an unseen success, must not bring a handle back).
    def freed(self, node_id: str, incarnation: str, request_id: str) -> bytes:
        return self._key("freed", escape(node_id), escape(incarnation), escape(request_id))

    def by_node_parts(self, key: bytes) -> tuple[str, str, str]:
        node, inc, req = key.decode("utf-8")[len(self.prefix) + len("by-node/") :].split("/")
        return unescape(node), unescape(inc), unescape(req)

    # claimed/{node}/{incarnation}/{request}: the claim, a check-out in flight of the
    # handle on those blocks, bound to the handle's lease. Keyed by the blocks, so that
    # the holder's report that it freed them consumes the claim without reading it first.
    def claimed_prefix(self, node_id: str | None = None, incarnation: str = "") -> bytes:
        if node_id is None:
            return self._key("claimed", "")
        return self._key("claimed", escape(node_id), escape(incarnation), "")

    def claimed(self, node_id: str, incarnation: str, request_id: str) -> bytes:
        return self._key("claimed", escape(node_id), escape(incarnation), escape(request_id))

    def claimed_parts(self, key: bytes) -> tuple[str, str, str]:
        node, inc, req = key.decode("utf-8")[len(self.prefix) + len("claimed/") :].split("/")
        return unescape(node), unescape(inc), unescape(req)

    def all_claims_prefix(self) -> bytes:
        """Every claim, whoever holds the blocks."""
        return self.claimed_prefix()

    # checkouts/{tenant}/{conversation}: the key of the conversation's latest claim, written
    # with it (same lease); a claim consumed or released since leaves it pointing at nothing.
    def checkout(self, tenant: str, conversation: str) -> bytes:
        return self._key("checkouts", escape(tenant), escape(conversation))

    # releases/{node}/{command id}: a release waiting for the node's ack,
    # bound to the released handle's lease (moot once the engine's own TTL
    # would have freed the blocks).
    def releases_prefix(self, node_id: str | None = None) -> bytes:
        if node_id is None:
            return self._key("releases", "")
        return self._key("releases", escape(node_id), "")

    def release(self, node_id: str, command_id: str) -> bytes:
        return self._key("releases", escape(node_id), escape(command_id))

    # election/{name}: leader election of singleton roles.
    def election(self, name: str) -> bytes:
        return self._key("election", escape(name))


def prefix_range_end(prefix: bytes) -> bytes:
    """The etcd range_end that selects every key starting with `prefix`."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"
