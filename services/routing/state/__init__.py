"""What a router remembers between turns: pure bookkeeping, no I/O, no clock reads.

- `inflight.py`: the work routed to each node that its load reports do not show yet.
- `prefill_record.py`: what each prefill node's prefix cache probably holds, from what was sent.
- `prompt_chains.py`: each conversation's prompt digest chain, hashed once per block.
- `suspects.py`: which nodes a route leaves out (failed this turn, or marked suspect).
- `routes.py`: the routes made (for their reports), each conversation's last prefill node,
  and the engine pairs that have met.

The `Router` (`routing/router/`) keeps one of each.
"""
