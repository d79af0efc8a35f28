"""The transaction pieces every store builds from: puts, deletes and the
comparisons that fence a write on a key's revision."""

from __future__ import annotations

from typing import Any

from aetcd import rpc


def put(key: bytes, value: bytes, lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def delete(key: bytes) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def get(key: bytes) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))


def same_revision(key: bytes, revision: int) -> Any:
    """The key was last written at `revision`: nobody changed it since it was read."""
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def absent(key: bytes) -> Any:
    """The key does not exist (its create revision is 0)."""
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=0)
