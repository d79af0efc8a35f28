"""Drop podman DNS records of containers and networks that no longer exist.

aardvark-dns, podman's DNS server, reads one file per network: the network's gateway address on
the first line, then one line per container (its id, its addresses, its names and aliases). When
a container's network teardown fails, its line outlives it. A network made later on the same
subnet (the next compose stage's, the next CI run's) is served from the same gateway address, and
its names can resolve to that dead container's address: connections to them time out
(podman issues 20396 and 22407).

    prune_podman_dns.py DIR --networks NAME... --containers ID...

DIR is aardvark-dns's folder (rootful: /run/containers/networks/aardvark-dns). A file whose
network is not among --networks is removed; in the others, lines whose container id is not among
--containers are dropped. Each dropped record is printed. The caller signals aardvark-dns (SIGHUP)
to reread the folder when this exits 0 and printed anything.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PID_FILE = "aardvark.pid"


def prune(folder: Path, networks: set[str], containers: set[str]) -> list[str]:
    """Prune the folder in place; returns one line per dropped record."""
    dropped: list[str] = []
    for path in sorted(folder.iterdir()):
        if path.name == PID_FILE or not path.is_file():
            continue
        lines = path.read_text().splitlines()
        if path.name not in networks:
            dropped += [f"{path.name}: {line}" for line in lines[1:] if line.strip()]
            dropped.append(f"{path.name}: network gone, file removed")
            path.unlink()
            continue
        kept = lines[:1]
        for line in lines[1:]:
            fields = line.split()
            if fields and fields[0] not in containers:
                dropped.append(f"{path.name}: {line}")
            else:
                kept.append(line)
        if len(kept) != len(lines):
            tmp = path.with_name(f".{path.name}.prune")
            tmp.write_text("".join(f"{line}\n" for line in kept))
            tmp.replace(path)
    return dropped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--networks", nargs="*", default=[])
    parser.add_argument("--containers", nargs="*", default=[])
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        return 0
    for line in prune(args.folder, set(args.networks), set(args.containers)):
        print(f"stale podman DNS record dropped: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
