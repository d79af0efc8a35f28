"""The processes of this machine, as tests that check what a command left running see them."""

from __future__ import annotations

from pathlib import Path


def processes_naming(text: str, but: int = 0) -> list[int]:
    """Running processes (other than `but`; zombies are not running) whose command line, its
    arguments joined by spaces, holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == but:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state != "Z" and text.encode() in cmdline:
            found.append(int(entry.name))
    return found
