#!/usr/bin/env bash
# Put opentelemetry-proto's and googleapis-common-protos' own modules back in a virtual
# environment after xds-protos was installed there.
#
#   deploy/scripts/restore_bundled_protos.sh VENV
#
# xds-protos (Envoy's ext_proc stubs, for `kvplane epp`) carries years-old copies of both
# packages' modules and writes them over theirs, in whichever order pip installed the three: the
# OTLP exporter then fails to import (no InstrumentationScope, no ResourceSpans.scope_spans).
# Each package is reinstalled, without dependencies, at the version pip already recorded for it,
# so this changes no version in any environment (tests/unit/test_bundled_protos.py checks .venv).
set -euo pipefail

VENV=${1:?usage: restore_bundled_protos.sh VENV}
pins=()
for pkg in opentelemetry-proto googleapis-common-protos; do
  version=$("$VENV/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$pkg" 2>/dev/null) ||
    continue
  pins+=("$pkg==$version")
done
if ((${#pins[@]})); then
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "${pins[@]}"
fi
