"""The routing service: per turn, where P and D run and whether P pulls D's retained KV.

- `router/`: the `Router`, where a turn is routed (snapshot → plan → account → learn), with
  its cluster, check-out and clock injected; the simulator calls the same class.
- `state/`: what the Router remembers between turns (in-flight work, the prefill record,
  prompt chains, routes awaiting reports, usable nodes): pure bookkeeping.
- `policy/`: the pure decision pipeline (filters, scorers, picker, pull rule,
  cost model), shared with the simulator.
- `service.py`: the grpc.aio servicer (Route, ReportTurn, EndConversation), thin adapters
  around the Router; `adapters.py`: the Router's ports over the view, the store and the clock.
- `reports.py`: what ReportTurn does besides learning (D's handle, a failed turn's P released);
  `prefill_release.py`: that release.
- `transfer_params.py`: the prefill leg's kv_transfer_params.
- `suspect_marker.py`: marking failed nodes suspect for every replica.
- `app.py`: `install(ctx)` for `kvplane serve routing` and `serve all`.
- `endpoints.py`: URLs and side-channel addresses, IPv6 bracketed.
- `metrics.py`: Prometheus metrics.
"""
