"""Compact JSON text for values kvplane builds itself (kv_transfer_params it sends on), in C.

orjson writes the value as `json.dumps(value, separators=(",", ":"), ensure_ascii=False)` would
(floats aside, which it may spell differently) at a fraction of the cost, which counts where it
runs on every Route with a handle's block ids in it. A value orjson refuses, an integer beyond 64
bits, is written by the standard library instead: every value that module accepts is written
whole.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps_compact(value: Any) -> str:
    """`value` as compact JSON text, key order kept."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
