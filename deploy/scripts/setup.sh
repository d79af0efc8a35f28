#!/usr/bin/env bash
# Installs everything kvplane needs on a Debian machine, as root: etcd and etcdctl,
# Node.js (for buf), a Python virtual environment with the project and its
# development tools, at the versions of deploy/constraints.txt. Idempotent: a
# second run installs nothing new. The first run takes 5-10 minutes on 2 cores
# and leaves about 2.3 GB on disk (.venv 2.0 GB, CPU torch 0.75 GB of it).
set -euo pipefail
cd "$(dirname "$0")/../.."

need_apt=()
command -v etcd >/dev/null || need_apt+=(etcd-server)
# etcdctl: the Helm chart's backup Job's steps run against a real etcd in the tests.
command -v etcdctl >/dev/null || need_apt+=(etcd-client)
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
# kvplane is installed editable in strict mode: build/__editable__.kvplane-*/kvplane is a tree of
# links to the source files, laid out as the wheel is, so mypy, IDEs and import linters see the
# same `kvplane.*` modules that Python imports (the default mode's import hook is invisible to
# them). A module added or removed since the last install is not in that tree: the stamp keeps
# the list of source files the tree was made from, and a change relinks it. So does a plain
# `pip install -e .` made by hand since (its import hook, a *_finder.py, replaces the tree).
stamp=.venv/.kvplane-installed
sources=$(find services connector bench protos/python -name __pycache__ -prune -o \
  \( -name '*.py' -o -name '*.pyi' -o -name py.typed -o -name '*.yaml' \) -print | LC_ALL=C sort)
editable=(--config-settings editable_mode=strict)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ deploy/constraints.txt -nt "$stamp" ]; then
  # torch first, the CPU build: NIXL's wheel needs torch, and PyPI's is the CUDA build.
  ./deploy/scripts/install_cpu_torch.sh .venv
  # pyproject.toml states ranges; the constraints make this install the tested one, exactly.
  echo "==> pip install -e .[dev] -c deploy/constraints.txt (strict editable)"
  .venv/bin/pip install -q -c deploy/constraints.txt -e '.[dev]' "${editable[@]}"
  # xds-protos writes old copies over two packages' modules; theirs are put back (the script says more).
  ./deploy/scripts/restore_bundled_protos.sh .venv
  printf '%s\n' "$sources" >"$stamp"
elif [ "$(cat "$stamp")" != "$sources" ] || ! compgen -G 'build/__editable__.kvplane-*/kvplane' >/dev/null ||
  compgen -G '.venv/lib/python*/site-packages/__editable___kvplane_*_finder.py' >/dev/null; then
  echo "==> modules added or removed (or a non-strict install): relinking the editable install"
  .venv/bin/pip install -q --no-deps -e . "${editable[@]}"
  printf '%s\n' "$sources" >"$stamp"
fi
echo "==> ready: $(etcd --version | head -1), $(.venv/bin/python --version)"
echo "    the kvplane command is .venv/bin/kvplane (\`source .venv/bin/activate\` puts it on PATH)"
