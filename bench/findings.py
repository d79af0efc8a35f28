"""The README's reading of the benchmark numbers, written from the numbers themselves.

Each sentence compares kvplane with a baseline on one figure and says why it
wins or loses, so the text stays true when the numbers move.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _by_name(results: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {str(r["name"]): r for r in results}


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _releases(row: Mapping[str, Any]) -> str:
    releases = row.get("releases", {})
    early = {k: v for k, v in releases.items() if k not in ("engine_pressure", "engine_ttl")}
    return ", ".join(f"{k} {v:,}" for k, v in sorted(early.items(), key=lambda kv: -kv[1])) or "none"


def _per(point: Mapping[str, Any]) -> str:
    gb_s = float(point["retained_gb_s"])
    return _pct(float(point["vs_oracle"]) / (gb_s / 1e6)) if gb_s > 0 else "-"


def findings(data: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    evict = _by_name(data.get("mooncake", {}).get("results", []))
    pinned = _by_name(data.get("mooncake_pinned", {}).get("results", []))
    kv, proxy, ttl, fresh = (
        evict.get(n) for n in ("kvplane", "vllm-proxy", "kvplane-ttl", "kvplane-fresh-loads")
    )
    oracle, none = evict.get("oracle"), evict.get("no-reuse")
    if kv and proxy and fresh and none:
        worse = kv["ttft_ms"]["p50"] > proxy["ttft_ms"]["p50"]
        out.append(
            f"- **TTFT, evicting fleet.** kvplane's p50 is {kv['ttft_ms']['p50']:.0f} ms against"
            f" {proxy['ttft_ms']['p50']:.0f} ms for vLLM's proxy and {none['ttft_ms']['p50']:.0f} ms"
            f" without reuse (p99 {kv['ttft_ms']['p99']:.0f} / {proxy['ttft_ms']['p99']:.0f} /"
            f" {none['ttft_ms']['p99']:.0f} ms)."
            + (
                " kvplane loses here: it picks prefill nodes from load reports up to 0.5 s old (the node"
                " agent's interval), so turns arriving together pile onto the node that looked idle, where"
                " round-robin spreads them."
                if worse
                else ""
            )
            + f" With loads current at every route (`kvplane-fresh-loads`) p50 is"
            f" {fresh['ttft_ms']['p50']:.0f} ms and p99 {fresh['ttft_ms']['p99']:.0f} ms: the routing"
            " service should add the prefill work it has just routed to each node's last report."
        )
    if kv and ttl and oracle and oracle["reused_tokens"]:
        text = (
            f"- **Reuse, evicting fleet.** kvplane reuses {_pct(kv['reused_fraction'])} of prompt tokens"
            f" ({_pct(kv['reused_tokens'] / oracle['reused_tokens'])} of the oracle's), the fixed-TTL"
            f" variant {_pct(ttl['reused_fraction'])}"
            + (f" and the proxy {_pct(proxy['reused_fraction'])}" if proxy else "")
            + "."
        )
        if proxy and kv["reused_fraction"] < max(ttl["reused_fraction"], proxy["reused_fraction"]):
            text += (
                " kvplane loses here: when a full decode node may evict its oldest handles for free, each"
                f" early release ({_releases(kv)}) only gives up KV that would have stayed until needed."
            )
        text += (
            " Memory is the binding limit on this trace: retaining every context for 450 s would take"
            " several TB, against the fleet's 1.4 TB."
        )
        out.append(text)
    if proxy and proxy.get("wrong_prefix_tokens"):
        out.append(
            f"- **Correctness.** The proxy imported {proxy['wrong_prefix_tokens']:,} tokens of KV computed"
            " for other tokens (histories that were edited or cut, which it does not check); vLLM would"
            " have served them silently. kvplane imported none: digests prove each pull"
            f" ({kv['decisions'].get('recompute_prefix_mismatch', 0) if kv else 0:,} turns recomputed"
            " on a mismatch). The oracle pulls the matching part of such prefixes, which kvplane's"
            " router does not: it recomputes the whole prompt."
        )
    pk, pp, pt = (pinned.get(n) for n in ("kvplane", "vllm-proxy", "kvplane-ttl"))
    if pk and pp and pt:
        out.append(
            f"- **Pinned KV (vLLM's real behaviour).** When retained KV stays allocated until it is read,"
            " released or expires, the proxy's fleet runs out of decode memory:"
            f" {_pct(pp['waited_turns'] / pp['turns'])} of turns wait for it and TTFT p50 grows to"
            f" {pp['ttft_ms']['p50'] / 1000:,.0f} s"
            f" (fixed-TTL kvplane: {pt['ttft_ms']['p50'] / 1000:,.0f} s). kvplane's early releases cut"
            f" that to a p50 of {pk['ttft_ms']['p50']:,.0f} ms and a p99 of"
            f" {pk['ttft_ms']['p99'] / 1000:,.0f} s, with {_pct(pk['waited_turns'] / pk['turns'])} of turns"
            " waiting; even so this fleet is short of decode memory for the trace. This is where early"
            " release pays, and where the evicting model above undersells it."
        )
    sweep = data.get("sweep", [])
    if sweep:
        top = max(p["capacity_gib"] for p in sweep)
        at_top = {p["name"]: p for p in sweep if p["capacity_gib"] == top}
        if "kvplane" in at_top and "vllm-proxy" in at_top:
            a, b = at_top["kvplane"], at_top["vllm-proxy"]
            out.append(
                f"- **Capacity.** At {top} GiB per decode node kvplane reuses {_pct(a['vs_oracle'])} of the"
                f" oracle's tokens with {a['retained_gb_s']:,.0f} GB·s retained; the proxy"
                f" {_pct(b['vs_oracle'])} with {b['retained_gb_s']:,.0f} GB·s. Per million GB·s retained,"
                f" kvplane gets {_per(a)} of the oracle's reuse and the proxy {_per(b)}."
            )
    return out
