#!/usr/bin/env bash
# Builds the wheel, installs it into a fresh venv and checks what it exposes:
# everything under `kvplane`, and no top-level `services` or `connector`.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/pip wheel -q --no-deps -w "$work/dist" . >/dev/null
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --no-deps "$work"/dist/kvplane-*.whl
"$work/venv/bin/pip" install -q "$(ls "$work"/dist/kvplane-*.whl)" >/dev/null
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
leaked=$(cd "$site" && ls -d services connector bench tests protos 2>/dev/null || true)
if [ -n "$leaked" ]; then
  echo "wheel leaks top-level modules: $leaked" >&2
  exit 1
fi
# Nothing in the wheel but the kvplane package and its metadata.
outside=$("$work/venv/bin/python" - "$work"/dist/kvplane-*.whl <<'PY'
import sys
import zipfile

tops = {name.split("/")[0] for name in zipfile.ZipFile(sys.argv[1]).namelist()}
print(" ".join(sorted(t for t in tops if t != "kvplane" and not t.endswith(".dist-info"))))
PY
)
if [ -n "$outside" ]; then
  echo "wheel holds top-level entries besides kvplane: $outside" >&2
  exit 1
fi
cd "$work"
"$work/venv/bin/python" - <<'PY'
import importlib
import importlib.util
for name in ["kvplane.services.metadata.service", "kvplane.services.common.store", "kvplane.v1.metadata_pb2",
             "kvplane.connector.digests", "kvplane.services.cli", "kvplane.services.client.routing_client",
             "kvplane.connector.simengine.command"]:
    module = importlib.import_module(name)
    assert "site-packages" in (module.__file__ or ""), module.__file__
# One name per module: the routing client is kvplane.services.client only.
assert importlib.util.find_spec("kvplane.client") is None, "kvplane.client is a second name"
print("wheel ok: kvplane.* importable from site-packages, one name each; no top-level services/connector")
PY
