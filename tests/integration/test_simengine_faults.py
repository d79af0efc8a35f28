"""Faults between turns: the holder of D's blocks dies; the next turn recomputes, fast, and succeeds."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.simengine import d_leg, engines, free_port, loads, p_leg, reference, sim, tokens


def test_a_killed_decode_engine_turns_the_next_pull_into_a_recompute(tmp_path: Path) -> None:
    specs = {name: sim(side_channel_port=free_port()) for name in ("P", "D")}
    with engines(tmp_path, specs) as started:
        p, d = started["P"], started["D"]
        prompt = tokens(41, 200)
        handle = None
        for _ in range(2):  # the second turn pulls, so P holds a live connection to D
            p_params = p_leg(p, prompt, handle)["kv_transfer_params"]
            dr = d_leg(d, prompt, p_params, 100)
            handle = dr["kv_transfer_params"]
            prompt = prompt + dr["choices"][0]["token_ids"] + tokens(42, 40)
        assert loads(p, "pulled") == 1

        d.process.kill()
        t0 = time.monotonic()
        pr = p_leg(p, prompt, handle)
        took = time.monotonic() - t0
        assert loads(p, "transfer_failed") == 1 and loads(p, "pulled") == 1
        assert took < 3.0, f"a dead holder must fail the READ fast, took {took:.1f} s"
        assert pr["kv_transfer_params"]["do_remote_prefill"] is True, "P still serves its own leg"
        assert pr["choices"][0]["token_ids"] == reference(p, prompt, 1)
