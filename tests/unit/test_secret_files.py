"""Secrets read from files: trimmed, refused when missing or empty, and a stamp that changes when
the file is rewritten or swapped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvplane.services.common.runtime.secret_files import SecretFileError, file_stamp, read_secret_file


def test_a_secret_is_read_without_the_newline_an_editor_adds(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  s3cret\n")
    assert read_secret_file(str(path), "client token") == "s3cret"


def test_a_missing_or_empty_secret_file_is_refused_naming_what_it_was_for(tmp_path: Path) -> None:
    with pytest.raises(SecretFileError, match="client token: cannot read"):
        read_secret_file(str(tmp_path / "absent"), "client token")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SecretFileError, match=r"mesh secret: .* is empty"):
        read_secret_file(str(empty), "mesh secret")


def test_the_stamp_changes_when_the_file_is_swapped_and_is_unreadable_while_gone(tmp_path: Path) -> None:
    path = tmp_path / "tls.crt"
    path.write_text("one")
    first = file_stamp(str(path))
    # A Kubernetes Secret volume swaps in a new file (a new inode), possibly of the same size.
    replacement = tmp_path / "tls.crt.new"
    replacement.write_text("two")
    os.replace(replacement, path)
    assert file_stamp(str(path)) != first
    path.unlink()
    assert file_stamp(str(path)) == (-1, -1, -1)
