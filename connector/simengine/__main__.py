"""python -m kvplane.connector.simengine [flags]: the same as `kvplane sim-engine`."""

from __future__ import annotations

import sys

from kvplane.connector.simengine.command import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
