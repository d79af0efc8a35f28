"""The eviction coordinator: releases retained KV early, safely, and for a reason.

Modules:

- `election`: leader election on `election/{name}` with an etcd lease;
  standbys watch the key and campaign when it goes.
- `coordinator`: one replica. Every replica keeps a warm cluster view and
  learns inter-turn gaps; the leader evaluates the retention policies,
  answers nodes' KV demand (sent on their command streams) at once,
  purges dead nodes' handles and drains nodes.
- `releaser`: one fenced `Store.release` transaction per decision; the
  metadata entry is gone before any command is sent.
- `sessions` / `service`: the `EvictionService.Commands` stream. The leader
  replays each node's outbox (`releases/{node}/`) on every connect and
  follows it by watch; an entry is deleted when the node acknowledges it.
  Standbys answer UNAVAILABLE, and the health name
  `kvplane.v1.EvictionService/leader` is SERVING only on the leader (for a
  readiness probe).
- `policy/`: pure retention plugins (max_age, demand, node_budget,
  tenant_budget, kv_pressure, low_value) over plain dataclasses, shared with
  the simulator. By default: max_age, demand and low_value; no headroom is
  kept empty ahead of need (node_budget and kv_pressure are opt-in limits).
- `config`: the `eviction:` settings section; `app.install` wires it all
  into a kvplane process (`kvplane serve eviction`, `kvplane serve all`).

Settings (YAML, or KVPLANE_EVICTION__<FIELD>):

    eviction:
      lease_ttl_s: 10
      evaluate_interval_s: 1.0
      policy:
        policies:
          - {name: max_age, engine_ttl_s: 480, margin_s: 30}
          - {name: demand}
          - {name: tenant_budget, default_bytes: 68719476736}
          - {name: low_value, min_ratio: 1.0}
"""
