"""Input limits and checks shared by every service.

Limits (bytes of UTF-8 unless said otherwise):
- tenant: 1..128; conversation: 1..512; node id, incarnation, engine id,
  request ids, route ids, handle ids: 1..128 (route/handle ids may be empty
  where optional);
- block-id lists: at most 8 groups of at most 1,048,576 ids each;
- a publish batch: 1..256 handles; a release report: 1..1024 request ids;
- labels: at most 32, keys 1..63 bytes, values up to 256 bytes;
- hosts: a DNS name (labels of letters, digits and hyphens) or an IP literal,
  at most 253 bytes; ports 1..65535;
- a handle's wall-clock expiry: in the future and at most MAX_HANDLE_LIFE_MS
  ahead; token and byte counts non-negative and below 2^53 (exact in JSON).

Every path that stores a handle (PublishHandles, ReportTurn) applies
`cache_handle` to the domain value, so no method accepts less.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from kvplane.services.common.model.errors import InvalidArgument
from kvplane.services.common.model.handles import CacheHandle

MAX_TENANT = 128
MAX_CONVERSATION = 512
MAX_ID = 128
MAX_GROUPS = 8
MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_PUBLISH_BATCH = 256
MAX_RELEASE_REPORT = 1024
MAX_LABELS = 32
MAX_HOST = 253
# Longest a published handle may live: far above any engine's KV TTL, so an expiry
# beyond it is a mistake or an attempt to pin KV for good.
MAX_HANDLE_LIFE_MS = 24 * 3600 * 1000
# Integers exchanged as JSON stay exact below 2^53.
MAX_COUNT = (1 << 53) - 1
MAX_BLOCK_ID = (1 << 63) - 1
MAX_PARALLEL = 4096

_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def text(value: str, field: str, *, max_bytes: int, required: bool = True) -> str:
    """A string field: present when required, at most `max_bytes` of UTF-8."""
    if not value:
        if required:
            raise InvalidArgument(field, "is required")
        return value
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidArgument(field, f"is {size} bytes; the limit is {max_bytes}")
    return value


def tenant(value: str, field: str = "tenant") -> str:
    return text(value, field, max_bytes=MAX_TENANT)


def conversation(value: str, field: str = "conversation") -> str:
    return text(value, field, max_bytes=MAX_CONVERSATION)


def ident(value: str, field: str, *, required: bool = True) -> str:
    return text(value, field, max_bytes=MAX_ID, required=required)


def in_range(value: int, field: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidArgument(field, f"is {value}; it must be between {low} and {high}")
    return value


def count(items: int, field: str, low: int, high: int) -> int:
    if not low <= items <= high:
        raise InvalidArgument(field, f"has {items} entries; it must have {low} to {high}")
    return items


def http_url(value: str, field: str) -> str:
    text(value, field, max_bytes=2048)
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(field, "must be an http(s) URL with a host; bracket IPv6 literals")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise InvalidArgument(field, "has an invalid port") from None
    return value


def host(value: str, field: str) -> str:
    """A bare DNS name or IP literal (IPv6 without brackets)."""
    text(value, field, max_bytes=MAX_HOST)
    if value.startswith("[") or value.endswith("]"):
        raise InvalidArgument(field, "must be a bare host; store IPv6 literals without brackets")
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise InvalidArgument(field, "is not a host name or IP literal")
    return value


def port(value: int, field: str) -> int:
    return in_range(value, field, 1, 65535)


def cache_handle(handle: CacheHandle, field: str, *, now_unix_ms: int) -> CacheHandle:
    """Every bound a stored handle must meet, whichever method it came through."""
    tenant(handle.tenant, f"{field}.tenant")
    conversation(handle.conversation, f"{field}.conversation")
    ident(handle.handle_id, f"{field}.handle_id", required=False)
    ident(handle.holder_node_id, f"{field}.holder_node_id")
    ident(handle.holder_incarnation, f"{field}.holder_incarnation")
    text(handle.model, f"{field}.model", max_bytes=256, required=False)
    v = handle.vllm
    ident(v.remote_engine_id, f"{field}.vllm.remote_engine_id")
    ident(v.remote_request_id, f"{field}.vllm.remote_request_id")
    host(v.remote_host, f"{field}.vllm.remote_host")
    port(v.remote_port, f"{field}.vllm.remote_port")
    count(len(v.remote_block_ids), f"{field}.vllm.remote_block_ids", 1, MAX_GROUPS)
    for i, group in enumerate(v.remote_block_ids):
        count(len(group), f"{field}.vllm.remote_block_ids[{i}]", 1, MAX_BLOCKS_PER_GROUP)
        if min(group) < 0 or max(group) > MAX_BLOCK_ID:
            raise InvalidArgument(f"{field}.vllm.remote_block_ids[{i}]", "has a block id out of range")
    in_range(v.remote_num_tokens, f"{field}.vllm.remote_num_tokens", 1, MAX_COUNT)
    in_range(v.tp_size, f"{field}.vllm.tp_size", 1, MAX_PARALLEL)
    for name, value in (("dcp_size", v.dcp_size), ("pp_size", v.pp_size)):
        if value is not None:
            in_range(value, f"{field}.vllm.{name}", 1, MAX_PARALLEL)
    if v.remote_registration_generation is not None:
        in_range(
            v.remote_registration_generation, f"{field}.vllm.remote_registration_generation", 0, MAX_COUNT
        )
    text(v.transfer_mode, f"{field}.vllm.transfer_mode", max_bytes=64, required=False)
    in_range(handle.retained_bytes, f"{field}.retained_bytes", 0, MAX_COUNT)
    latest = now_unix_ms + MAX_HANDLE_LIFE_MS
    if not now_unix_ms < handle.wall_expiry_unix_ms <= latest:
        raise InvalidArgument(
            f"{field}.wall_expiry_unix_ms",
            f"must be in the future, at most {MAX_HANDLE_LIFE_MS // 1000} s ahead (ms since the epoch)",
        )
    return handle
