#!/usr/bin/env bash
# Installs everything kvplane needs on a Debian machine, as root: etcd,
# Node.js (for buf), a Python virtual environment with the project and its
# development tools. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/../.."

need_apt=()
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v make >/dev/null || need_apt+=(make)
command -v gcc >/dev/null || need_apt+=(gcc)
command -v npm >/dev/null || need_apt+=(nodejs npm)
command -v python3 >/dev/null || need_apt+=(python3 python3-dev)
python3 -m venv --help >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "==> apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

if [ ! -x node_modules/.bin/buf ]; then
  echo "==> npm install @bufbuild/buf"
  npm install --no-save --no-audit --no-fund --silent @bufbuild/buf@1.75.0
fi

if [ ! -x .venv/bin/python ]; then
  echo "==> python venv"
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.kvplane-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> pip install -e .[dev]"
  # torch first and pinned: NIXL's wheel needs it, and 2.13.0 is the CPU
  # build; an unpinned torch pulls a multi-GB CUDA build.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[dev]'
  touch "$stamp"
fi
echo "==> ready: $(etcd --version | head -1), $(.venv/bin/python --version)"
