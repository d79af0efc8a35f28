"""kvplane's etcd users, their role and what it may touch. Pure: names and a key range.

Every kvplane process that opens the etcd store is an etcd user of its own, named by the
Common Name of its client certificate: etcd, started with `--client-cert-auth`, takes a
certificate's CN as the user when a call carries no token. The users have no password, so a
certificate is the only way in. They share one role, read and write on kvplane's prefix and
nothing else: a process's certificate cannot read, or write over, what else the etcd holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.services.common.model.keys import prefix_range_end

# etcd's own superuser and its built-in role: user and role administration, `auth enable`, and
# what needs the whole keyspace (snapshots, defragmentation). etcd enables auth only once it exists.
ROOT_USER = "root"
ROOT_ROLE = "root"
# The role kvplane's processes share (read and write on the prefix).
ROLE = "kvplane"

# The processes that open the store, by kind, and the etcd user each is: the three services, and
# a gateway routing in its own process (`gateway.routing_in_process`). `kvplane serve all`
# (metadata, routing and eviction in one process) presents metadata's.
PROCESS_USERS: dict[str, str] = {
    "metadata": "kvplane-metadata",
    "routing": "kvplane-routing",
    "eviction": "kvplane-eviction",
    "gateway": "kvplane-gateway",
}


@dataclass(frozen=True, slots=True)
class KeyRange:
    """etcd's [key, range_end): every key that starts with `key`."""

    key: bytes
    range_end: bytes


def prefix_range(prefix: str) -> KeyRange:
    """The range of every key under kvplane's prefix (`etcd.prefix`)."""
    if not prefix:
        raise ValueError("an empty etcd prefix would grant the whole keyspace")
    key = prefix.encode()
    return KeyRange(key, prefix_range_end(key))


def process_users() -> tuple[str, ...]:
    """kvplane's etcd users, one per process kind."""
    return tuple(PROCESS_USERS.values())
