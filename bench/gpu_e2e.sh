#!/usr/bin/env bash
# Device check for one GPU machine: two vLLM engines (P and D) with kvplane's connector, the
# metadata service and etcd; the 3-turn end-to-end check, then a TTFT sweep of 2k-24k prompt
# tokens with and without reuse of D's retained KV.
#
#   bench/gpu_e2e.sh OUT_DIR [MODEL_DIR] [extra args for kvplane.bench.gpu_pd_bench]
#
# Installs nothing. It needs, already on the machine:
#   - a Python with the project and the `vllm` extra (vllm==0.32.0, nixl): $PYTHON, default
#     .venv/bin/python (e.g. `pip install -e '.[vllm]'` done beforehand);
#   - an `etcd` binary on PATH;
#   - a local model directory (MODEL_DIR), or none: the tiny random-weight model is built
#     offline (its TTFT figures are then not meaningful, the correctness check still is).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?usage: bench/gpu_e2e.sh OUT_DIR [MODEL_DIR] [args...]}
shift
MODEL=${1:-}
[[ $# -gt 0 ]] && shift
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
"$PYTHON" - <<'PY'
import importlib.metadata as md, importlib.util, shutil, sys
missing = [p for p in ("vllm", "nixl") if importlib.util.find_spec(p) is None]
if missing or shutil.which("etcd") is None:
    sys.exit(f"not installed here: {missing or ''} {'' if shutil.which('etcd') else 'etcd'}")
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible")
print("vllm", md.version("vllm"), "torch", torch.__version__, "gpu", torch.cuda.get_device_name(0))
PY

mkdir -p "$OUT"
ARGS=(--out "$OUT" --vllm-python "$PYTHON")
[[ -n $MODEL ]] && ARGS+=(--model "$MODEL")
cd "$ROOT"
exec "$PYTHON" -m kvplane.bench.gpu_pd_bench "${ARGS[@]}" "$@"
