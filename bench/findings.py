"""docs/benchmarks.md's reading of each benchmark table, written from the table's own numbers.

One paragraph per table: who has the lowest TTFT at each percentile, where
kvplane stands against the best baseline (and where it loses), and the
figures that explain it: turns that waited for decode memory, prompt tokens
not recomputed (pulled from D or found in P's own cache), turns that
would have answered from the wrong KV, and whose answers streamed slower
(TPOT), with the prefills each ran on D. Every clause is conditioned on the
numbers, so the text stays true when they move.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvplane.bench.sim.baselines import CONTENDERS as BASELINES

QUANTILES = ("p50", "p90", "p99")
# A share of turns below this is not worth a clause.
NOTABLE = 0.01
# A TPOT p99 this much above the lowest is worth a clause.
NOTABLE_TPOT = 0.02
# Decisions that run a turn's prefill on its decode node.
ON_DECODE_DECISIONS = ("local_prefill", "prefill_on_decode")


def _by_name(results: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {str(r["name"]): r for r in results}


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _ms(x: float) -> str:
    if x >= 100_000:
        return f"{x / 1000:,.0f} s"
    return f"{x:,.0f} ms"


def _ttft(r: Mapping[str, Any], q: str) -> float:
    return float(r["ttft_ms"][q])


def _winners(contenders: Sequence[Mapping[str, Any]]) -> str:
    """Who has the lowest TTFT at each percentile, grouped when one policy wins several."""
    best = {q: min(contenders, key=lambda r: (_ttft(r, q), str(r["name"]))) for q in QUANTILES}
    groups: dict[str, list[str]] = {}
    for q in QUANTILES:
        groups.setdefault(str(best[q]["name"]), []).append(q)
    parts = []
    for name, qs in groups.items():
        values = " / ".join(_ms(_ttft(best[q], q)) for q in qs)
        parts.append(f"`{name}` at {', '.join(qs)} ({values})")
    return "Lowest TTFT over all turns: " + "; ".join(parts) + "."


def _kvplane_against_baselines(kv: Mapping[str, Any], baselines: Sequence[Mapping[str, Any]]) -> str:
    losses, wins = [], []
    for q in QUANTILES:
        best = min(baselines, key=lambda r: (_ttft(r, q), str(r["name"])))
        mine, theirs = _ttft(kv, q), _ttft(best, q)
        if mine > theirs:
            losses.append(f"{q} {_ms(mine)} against `{best['name']}`'s {_ms(theirs)}")
        else:
            wins.append(f"{q} {_ms(mine)} against `{best['name']}`'s {_ms(theirs)}")
    text = ""
    if wins:
        text += f"kvplane is at or below the best baseline at {'; '.join(wins)}."
    if losses:
        text += (" " if text else "") + f"kvplane loses at {'; '.join(losses)}."
    return text


def _waits(by: Mapping[str, Mapping[str, Any]]) -> str:
    waited = [
        (name, float(r["waited_turn_fraction"]))
        for name, r in by.items()
        if float(r.get("waited_turn_fraction", 0.0)) >= NOTABLE
    ]
    if not waited:
        return "No policy's turns waited for decode memory."
    listed = ", ".join(f"`{n}` {_pct(w)}" for n, w in sorted(waited, key=lambda nw: -nw[1]))
    text = (
        f"Turns that waited for decode memory held by retained KV: {listed}; a waiting turn gets"
        " its first token only once memory frees, which is what drives those policies' TTFT."
    )
    kv = by.get("kvplane")
    if kv is not None and float(kv.get("waited_turn_fraction", 0.0)) >= NOTABLE:
        text += " For kvplane this means its releases did not free pinned KV fast enough on this fleet."
    return text


def _reuse(by: Mapping[str, Mapping[str, Any]]) -> str:
    parts = []
    for name in ("kvplane", "prefix-affinity", "vllm-proxy-checked", "oracle"):
        r = by.get(name)
        if r is None or not r.get("prompt_tokens"):
            continue
        prompt = float(r["prompt_tokens"])
        parts.append(
            f"`{name}` {_pct(float(r['reused_token_fraction']))}"
            f" ({_pct(r['pulled_tokens'] / prompt)} pulled from D,"
            f" {_pct(r['cached_tokens'] / prompt)} from P's own cache)"
        )
    text = "Prompt tokens not recomputed: " + "; ".join(parts) + "." if parts else ""
    kv, affinity = by.get("kvplane"), by.get("prefix-affinity")
    if kv and affinity and float(kv["reused_token_fraction"]) < float(affinity["reused_token_fraction"]):
        text += " kvplane reuses less than prefix-affinity's P-cache routing alone."
    return text


def _wrong(by: Mapping[str, Mapping[str, Any]]) -> str:
    wrong = [(n, int(r.get("wrong_prefix_turns", 0))) for n, r in by.items() if r.get("wrong_prefix_turns")]
    if not wrong:
        return "No policy pulled KV computed for other tokens."
    listed = ", ".join(f"`{n}` {c:,} turns ({_pct(c / max(1, int(by[n]['turns'])))})" for n, c in wrong)
    return (
        f"Turns that would have answered from KV computed for other tokens (an edited or cut history"
        f" pulled without a prefix check): {listed}. Their TTFT is counted above like any other turn's;"
        " their output would be wrong."
    )


def _tpot(by: Mapping[str, Mapping[str, Any]]) -> str:
    """Whose answers streamed slower at p99, and which of them ran prefills on the decode nodes:
    a decode step slows with every answer it carries and every prefill it runs (TTFT shows
    neither)."""
    tpots = {n: float(r["tpot_ms"]["p99"]) for n, r in by.items() if "tpot_ms" in r and n != "oracle"}
    if not tpots:
        return ""
    low_name, low = min(tpots.items(), key=lambda nt: (nt[1], nt[0]))
    slower = sorted(((n, t) for n, t in tpots.items() if t > low * (1 + NOTABLE_TPOT)), key=lambda nt: -nt[1])
    if not slower:
        return f"TPOT p99 is within {NOTABLE_TPOT:.0%} of the lowest ({low:.1f} ms) for every policy."
    parts = []
    for name, tpot in slower:
        r = by[name]
        on_decode = sum(int(r.get("decisions", {}).get(d, 0)) for d in ON_DECODE_DECISIONS)
        share = f" ({_pct(on_decode / max(1, int(r['turns'])))} of turns prefilled on D)" if on_decode else ""
        parts.append(f"`{name}` {tpot:.1f} ms{share}")
    return (
        f"TPOT p99 (time per output token after the first): {', '.join(parts)}, against {low:.1f} ms"
        f" (`{low_name}`). A decode step slows with every answer it carries and every prefill the"
        " decode node runs itself, a cost TTFT does not show."
    )


def table_paragraph(results: Sequence[Mapping[str, Any]], *, evicting: bool = False) -> str:
    """The reading of one comparison table (its rows as `SimSummary.as_dict()` gives them)."""
    by = _by_name(results)
    contenders = [r for r in results if r["name"] != "oracle"]
    if not contenders:
        return ""
    sentences = [_winners(contenders)]
    baselines = [by[n] for n in BASELINES if n in by]
    if "kvplane" in by and baselines:
        sentences.append(_kvplane_against_baselines(by["kvplane"], baselines))
    sentences += [_waits(by), _reuse(by), _wrong(by), _tpot(by)]
    if evicting:
        sentences.append(
            "In this what-if a full decode node drops retained KV for free, so holding KV costs no"
            " waiting; vLLM's decode engine does not do this."
        )
    return " ".join(s for s in sentences if s)
