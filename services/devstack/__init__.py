"""The whole system on one machine, for development and tests (`kvplane dev-stack`, `make run`).

- `processes`: the process supervisor: a child in its own process group, with its log file,
  started, probed until ready, restarted, and stopped (with all its group).
- `credentials`: the stack's bearer tokens, one per process, in files only its owner reads.
- `stack`: the recipe: etcd, `kvplane serve all`, the sim-engines and the gateway, with their
  settings; `start_stack()` for tests and benchmarks.
- `demo`: the multi-turn demo run through the gateway, and its table.
- `names`: what the stack names its parts (the model), importable without the stack.
- `cli`: `kvplane dev-stack`'s command line.
"""
