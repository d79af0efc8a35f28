"""Properties of the routing policy over generated clusters: what must hold for every plan."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.services.common.model.nodes import Fingerprint, NodeRole
from kvplane.services.routing.policy import Decision, NoEligibleNodes, Prompt, RoutingPolicy, load_policy
from kvplane.services.routing.policy.snapshot import NodeState
from tests.unit.routing_policy_fixtures import NOW, history, mk_handle, mk_load, mk_node, snap

POLICY = RoutingPolicy(load_policy())
FINGERPRINTS = [
    Fingerprint("m", "bfloat16", "NHD"),
    Fingerprint("m", "fp8_e4m3", "NHD"),
    Fingerprint("x", "bf16", ""),
]
HISTORY = history(2048)


@st.composite
def clusters(draw: st.DrawFn) -> list[NodeState]:
    states = []
    for i in range(draw(st.integers(0, 8))):
        node = mk_node(
            f"n{i}",
            draw(st.sampled_from(list(NodeRole))),
            fingerprint=draw(st.sampled_from(FINGERPRINTS)),
            draining=draw(st.booleans()),
        )
        load = None
        if draw(st.booleans()):
            total = draw(st.integers(0, 10_000))
            load = mk_load(
                node,
                queued_prefill_tokens=draw(st.integers(0, 500_000)),
                running_requests=draw(st.integers(0, 300)),
                free_kv_blocks=draw(st.integers(0, total)),
                total_kv_blocks=total,
                reported_unix_ms=NOW - draw(st.integers(0, 60_000)),
            )
        states.append(NodeState(node, load))
    return states


@settings(max_examples=300, deadline=None)
@given(
    nodes=clusters(),
    holder_index=st.integers(0, 8),
    life_ms=st.integers(-10_000, 600_000),
    extra=st.integers(0, 600),
    edit_at=st.one_of(st.none(), st.integers(0, 2047)),
)
def test_every_plan_is_safe(
    nodes: list[NodeState], holder_index: int, life_ms: int, extra: int, edit_at: int | None
) -> None:
    handle = None
    if nodes:
        holder = nodes[holder_index % len(nodes)].node
        handle = mk_handle(holder, HISTORY, life_ms=life_ms)
    prompt_ids = [*HISTORY, *history(extra, seed=4)]
    if edit_at is not None:
        prompt_ids[edit_at] = 0
    snapshot = snap(nodes, handle=handle, prompt=Prompt(len(prompt_ids), prompt_ids))
    try:
        plan = POLICY.route(snapshot)
    except NoEligibleNodes:
        # Only when no node pair can serve the model with a shared fingerprint.
        pairs = [
            (p, d)
            for p in nodes
            for d in nodes
            if p.node.role.can_prefill()
            and d.node.role.can_decode()
            and p.node.fingerprint == d.node.fingerprint
            and p.node.fingerprint.model == "m"
        ]
        assert not pairs
        return
    assert plan.prefill.role.can_prefill() and plan.decode.role.can_decode()
    assert plan.prefill.fingerprint == plan.decode.fingerprint
    assert plan.prefill.fingerprint.model == "m"
    if plan.decision is Decision.PULL:
        assert handle is not None
        holder = next(s.node for s in nodes if s.node.node_id == handle.holder_node_id)
        assert not holder.draining and holder.role.can_decode()
        assert plan.prefill.fingerprint == holder.fingerprint
        assert edit_at is None or edit_at >= 2048 // 16 * 16
        assert plan.verdict.reusable_tokens >= POLICY.config.pull.threshold_tokens
        assert handle.life_left_ms(NOW) >= POLICY.config.pull.expiry_margin_ms
    # Same inputs, same plan.
    assert POLICY.route(snapshot) == plan
