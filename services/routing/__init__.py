"""The routing service: per turn, where P and D run and whether P pulls D's retained KV.

- `service.py`: the grpc.aio servicer (Route, ReportTurn, EndConversation).
- `app.py`: `install(ctx)` for `kvplane serve routing` and `serve all`.
- `policy/`: the pure decision pipeline (filters, scorers, picker, pull rule,
  cost model), shared with the simulator.
- `endpoints.py`: URLs and side-channel addresses, IPv6 bracketed.
- `metrics.py`: Prometheus metrics; `bounded_map.py`: per-replica memory.
"""
