"""Secrets kept in files (Kubernetes Secret volumes, Docker secrets): read, trimmed, never logged;
and the stamp by which a reader of such files (keys, tokens, certificates) sees that one changed."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)
# Files already warned of as readable by others (one warning per file and process).
_WARNED: set[str] = set()


class SecretFileError(ValueError):
    """A configured secret file is missing, unreadable, empty, or writable by others."""


def check_file_mode(path: str, what: str) -> None:
    """Refuses a secret file that group or others may write (whoever can write it can add or
    swap a credential); warns, once, of one that others may read."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # reading it says why
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SecretFileError(
            f"{what}: {path!r} is writable by group or others (mode {stat.S_IMODE(mode):04o}): "
            "make it 0600 or 0400 (chmod go-w)"
        )
    if mode & stat.S_IROTH and path not in _WARNED:
        _WARNED.add(path)
        log.warning(
            "%s: %r is readable by others (mode %04o); 0400 or 0600 keeps it to its owner",
            what,
            path,
            stat.S_IMODE(mode),
        )


def read_secret_file(path: str, what: str) -> str:
    """The file's text without surrounding whitespace (editors and `echo` add a newline)."""
    check_file_mode(path, what)
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
