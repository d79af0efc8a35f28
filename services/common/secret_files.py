"""Secrets kept in files (Kubernetes Secret volumes, Docker secrets): read, trimmed, never logged."""

from __future__ import annotations

from pathlib import Path


class SecretFileError(ValueError):
    """A configured secret file is missing, unreadable or empty."""


def read_secret_file(path: str, what: str) -> str:
    """The file's text without surrounding whitespace (editors and `echo` add a newline)."""
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretFileError(f"{what}: cannot read {path!r}: {exc}") from None
    if not value:
        raise SecretFileError(f"{what}: {path!r} is empty")
    return value
