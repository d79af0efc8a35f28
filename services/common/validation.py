"""Input limits and checks shared by every service.

Limits (bytes of UTF-8 unless said otherwise):
- tenant: 1..128; conversation: 1..512; node id, incarnation, engine id,
  request ids, route ids, handle ids: 1..128 (route/handle ids may be empty
  where optional);
- block-id lists: at most 8 groups of at most 1,048,576 ids each;
- a publish batch: 1..256 handles; a release report: 1..1024 request ids;
- labels: at most 32, keys 1..63 bytes, values up to 256 bytes.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvplane.services.common.errors import InvalidArgument

MAX_TENANT = 128
MAX_CONVERSATION = 512
MAX_ID = 128
MAX_GROUPS = 8
MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_PUBLISH_BATCH = 256
MAX_RELEASE_REPORT = 1024
MAX_LABELS = 32


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
    text(value, field, max_bytes=255)
    if value.startswith("[") or value.endswith("]"):
        raise InvalidArgument(field, "must be a bare host; store IPv6 literals without brackets")
    if any(c.isspace() or c == "/" for c in value):
        raise InvalidArgument(field, "is not a host name or IP literal")
    return value
