"""kvplane's error types. Each maps to one canonical gRPC status (see grpc_errors)."""

from __future__ import annotations


class KvplaneError(Exception):
    """Base of every error kvplane raises on purpose."""


class InvalidArgument(KvplaneError):
    """A request field is malformed or out of range."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotFound(KvplaneError):
    """The named node, handle or lease does not exist."""


class HandleNotRetained(KvplaneError):
    """The handle exists but is no longer retained (checked out or replaced)."""


class NodeNotRegistered(KvplaneError):
    """The node or incarnation named is not the registered one."""


class PermissionDenied(KvplaneError):
    """The caller may not act on this tenant or object."""


class Unauthenticated(KvplaneError):
    """The caller presented no valid credentials."""


class StoreUnavailable(KvplaneError):
    """etcd could not be reached, or did not answer in time."""


class NotLeader(KvplaneError):
    """This replica is a standby; the leader acts."""
