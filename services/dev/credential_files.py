"""Writing a set of credential files (certificates, keys, tokens) under one folder: each file whole,
secrets 0600, nothing over an existing file unless asked."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


class CredentialFilesExist(Exception):
    """Files that would be written exist already (and `overwrite` was not asked for)."""


def existing(out: Path, relatives: Sequence[str]) -> list[str]:
    """Which of the files are there already."""
    return [r for r in relatives if (out / r).exists()]


def write_files(
    out: Path,
    files: Mapping[str, bytes],
    secret: Callable[[str], bool],
    *,
    overwrite: bool = False,
    owner: tuple[int, int] | None = None,
) -> None:
    """Writes every file under `out` (by its path relative to it): secret ones 0600, the others
    0644, folders 0700. Each file appears whole (written aside, then renamed). Refuses, before
    writing anything, when one exists and `overwrite` is false. `owner` (uid, gid): whom folders
    and files belong to (a root init container writing for another user)."""
    there = existing(out, list(files))
    if there and not overwrite:
        raise CredentialFilesExist(
            f"{len(there)} of the files exist already, e.g. {out / there[0]}: "
            "remove them, or pass --force to write new ones over them"
        )
    folders = sorted({(out / relative).parent for relative in files} | {out})
    for folder in folders:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if owner is not None:
            os.chown(folder, *owner)
    for relative, content in files.items():
        path = out / relative
        temporary = path.with_name(f".{path.name}.new")
        # Created 0600, so a secret is never readable by others, even for a moment.
        with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(content)
            os.fchmod(f.fileno(), 0o600 if secret(relative) else 0o644)
            if owner is not None:
                os.fchown(f.fileno(), *owner)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)


def parse_owner(value: str) -> tuple[int, int] | None:
    """`--owner UID:GID` (or UID alone, the group then the same number); empty: None."""
    if not value:
        return None
    uid, _, gid = value.partition(":")
    try:
        return int(uid), int(gid or uid)
    except ValueError:
        raise ValueError(f"--owner {value!r}: expected UID:GID (numbers)") from None


def add_write_options(parser: argparse.ArgumentParser) -> None:
    """The options every command writing a credential set takes: --force, --if-missing, --owner."""
    parser.add_argument("--force", action="store_true", help="write over existing files (default: refuse)")
    parser.add_argument(
        "--if-missing",
        action="store_true",
        help="when every file exists already, keep them and succeed (a container run at each start); "
        "some but not all: refuse (default: refuse whenever one exists)",
    )
    parser.add_argument(
        "--owner",
        default="",
        metavar="UID:GID",
        help="give folders and files to this user and group (run as root for another user; default: "
        "the caller)",
    )


def write_set(
    out: Path, files: Mapping[str, bytes], secret: Callable[[str], bool], args: argparse.Namespace
) -> bool:
    """Writes the set as add_write_options' options ask; False when --if-missing kept a whole set
    that was there already. Raises CredentialFilesExist, ValueError (a bad --owner) or OSError."""
    owner = parse_owner(args.owner)
    if args.if_missing and not args.force and len(existing(out, list(files))) == len(files):
        return False
    write_files(out, files, secret, overwrite=args.force, owner=owner)
    return True
