"""Secrets kept in files (Kubernetes Secret volumes, Docker secrets): read, trimmed, never logged;
and the stamp by which a reader of such files (keys, tokens, certificates) sees that one changed."""

from __future__ import annotations

import os
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


FileStamp = tuple[int, int, int]


def file_stamp(path: str) -> FileStamp:
    """What changes when a file is rewritten or swapped (a Kubernetes Secret volume swaps a link):
    its modification time, size and inode; all -1 while it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1, -1)
    return (st.st_mtime_ns, st.st_size, st.st_ino)
