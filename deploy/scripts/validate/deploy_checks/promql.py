"""The metric names a PromQL expression reads: a small tokenizer, enough for the chart's dashboard
and alert rules (and Grafana's `$__rate_interval` and other variables in range brackets).

Strings, label matchers (`{...}`), ranges and subqueries (`[...]`) and grouping label lists
(`by (...)`, `on (...)`, ...) are dropped; an identifier left is a metric name unless it calls
(is followed by `(`), is an aggregation operator or a keyword.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>\d[\w.]*(?:[eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<open>[({\[])
  | (?P<close>[)}\]])
  | (?P<space>\s+)
  | (?P<other>[^\s])
    """,
    re.VERBOSE,
)
# PromQL's aggregation operators, which take a `by (...)` before their argument.
AGGREGATIONS = frozenset(
    {
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
        "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    }
)  # fmt: skip
_LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = _LABEL_LISTS | {"offset", "bool", "and", "or", "unless", "atan2"}
_PAIRS = {"(": ")", "{": "}", "[": "]"}


class PromQLError(ValueError):
    pass


def _tokens(expr: str) -> list[tuple[str, str]]:
    out = []
    for m in _TOKEN.finditer(expr):
        kind = m.lastgroup or ""
        if kind not in ("space", "string"):
            out.append((kind, m.group()))
    return out


def _skip_group(tokens: list[tuple[str, str]], i: int) -> int:
    """The index after the bracketed group that opens at `i`."""
    stack = [tokens[i][1]]
    i += 1
    while stack:
        if i >= len(tokens):
            raise PromQLError(f"unclosed {stack[-1]!r}")
        kind, text = tokens[i]
        if kind == "open":
            stack.append(text)
        elif kind == "close" and _PAIRS[stack.pop()] != text:
            raise PromQLError(f"mismatched {text!r}")
        i += 1
    return i


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` reads. Raises PromQLError for unbalanced brackets."""
    tokens = _tokens(expr)
    names: set[str] = set()
    depth = 0
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text in ("{", "["):
            i = _skip_group(tokens, i)
            continue
        if kind == "name" and text in _LABEL_LISTS and following == "(":
            i = _skip_group(tokens, i + 1)
            continue
        if kind == "open":
            depth += 1
        elif kind == "close":
            depth -= 1
            if depth < 0:
                raise PromQLError(f"unopened {text!r}")
        elif kind == "name" and following != "(" and text not in AGGREGATIONS and text not in KEYWORDS:
            names.add(text)
        i += 1
    if depth:
        raise PromQLError("unclosed '('")
    return names
