#!/usr/bin/env bash
# Installs the CPU build of torch into a virtual environment (NIXL's wheel needs torch).
#
#   deploy/scripts/install_cpu_torch.sh VENV [VERSION]          default VERSION: 2.13.0
#
# PyPI's Linux x86_64 torch is the CUDA build: several GB of CUDA libraries a CPU machine never
# uses. PyTorch's own CPU index has the CPU build, so it is tried first; where it cannot be reached
# (only a registry mirror, no internet), the pinned version comes from pip's configured index.
#
#   KVPLANE_TORCH_INDEX        the CPU index (default https://download.pytorch.org/whl/cpu)
#   KVPLANE_TORCH_TIMEOUT_S    how long an unreachable index may take to fail (default 15)
set -euo pipefail

VENV=${1:?usage: install_cpu_torch.sh VENV [VERSION]}
VERSION=${2:-2.13.0}
INDEX=${KVPLANE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
TIMEOUT_S=${KVPLANE_TORCH_TIMEOUT_S:-15}
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)

if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$VERSION')" 2>/dev/null; then
  exit 0
fi
reachable() {
  "$VENV/bin/python" - "$INDEX" "$TIMEOUT_S" <<'PY'
import sys
import urllib.request

index, timeout_s = sys.argv[1].rstrip("/"), float(sys.argv[2])
try:
    urllib.request.urlopen(f"{index}/torch/", timeout=timeout_s).close()
except Exception as exc:  # any failure means: use the fallback
    print(f"==> {index} is not reachable ({exc})")
    sys.exit(1)
PY
}

if reachable; then
  echo "==> torch $VERSION, CPU build, from $INDEX"
  "${PIP[@]}" --index-url "$INDEX" "torch==$VERSION"
else
  echo "==> torch==$VERSION from pip's configured index instead (on Linux x86_64 PyPI's is the CUDA build, several GB)"
  "${PIP[@]}" "torch==$VERSION"
fi
