"""python -m kvplane.bench.simengine [flags]: the same as `kvplane sim-engine`."""

from __future__ import annotations

import sys

from kvplane.services.cli import sim_engine_main

if __name__ == "__main__":
    sys.exit(sim_engine_main(sys.argv[1:]))
