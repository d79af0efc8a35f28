#!/usr/bin/env bash
# Create a virtual environment with vLLM 0.33.0's Python code on CPU torch, in which the
# connector's tests run against 0.33's real scheduler classes (no engine, no model run).
#
#   deploy/scripts/install_vllm_033.sh [VENV]        default VENV: <repo>/.venv-vllm033
#
# vLLM 0.33.0 is published for CUDA only (there is no vllm-cpu 0.33). Its scheduler, KV-cache
# manager and connector classes are plain Python, so they import beside CPU torch: the steps
# are install_vllm_cpu.sh's (vllm_env.sh), with the CUDA kernel packages also left out of
# vLLM's requirements (the wheel asks for the CUDA torch 2.14.0, which this environment never
# needs). The two-engine end-to-end test needs a real CPU engine and stays on vllm-cpu 0.32.
# Re-running the script is safe: pip leaves satisfied requirements alone.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${1:-$ROOT/.venv-vllm033}
PYTHON=${PYTHON:-python3.11}
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1
# Packages that exist only to run CUDA kernels (the nvidia-* ones are always left out).
CUDA_ONLY=(
  pynvvideocodec flashinfer-python apache-tvm-ffi tilelang nvtx fastsafetensors instanttensor
  quack-kernels tokenspeed-mla humming-kernels numba
)
# shellcheck source=vllm_env.sh
source "$ROOT/deploy/scripts/vllm_env.sh"

say() { printf 'install_vllm_033: %s\n' "$*"; }

if [[ ! -x $VENV/bin/python ]]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

say "CPU torch $TORCH_VERSION"
vllm_env_cpu_torch "$VENV" "$TORCH_VERSION"
say "vllm $VLLM_VERSION without dependencies (a ~340 MB wheel)"
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "vllm==$VLLM_VERSION"
say "vLLM's common requirements; pip then reports vllm's CUDA-only requirements and"
say "torch==2.14.0 as missing or conflicting: expected, they are left out on purpose"
vllm_env_requirements "$VENV" vllm "$TORCH_VERSION" "${CUDA_ONLY[@]}"
say "NIXL $NIXL_VERSION and kvplane (editable, dev extras)"
vllm_env_nixl_and_kvplane "$VENV" "$ROOT" "$NIXL_VERSION" "$TORCH_VERSION"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from kvplane.connector.vllm_nixl import NixlConnector  # noqa: F401
print("vllm", md.version("vllm"), "torch", md.version("torch"), "nixl-cu12", md.version("nixl-cu12"))
PY
