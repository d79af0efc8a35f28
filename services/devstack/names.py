"""Names the dev stack gives its parts, for the benchmarks and demos that talk to it (a module of
its own so that they can name them without importing the stack)."""

from __future__ import annotations

# The model the stack's engines serve.
DEMO_MODEL = "sim-model"
