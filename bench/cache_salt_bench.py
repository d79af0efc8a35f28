"""What per-tenant prefix-cache isolation (`cache_salt`) costs in reuse, on the sim-engine's prefix cache.

A workload where caching across tenants would pay most: every tenant's requests open with the same
system prompt, then a tenant-wide document, then a question of their own. The same requests run
through one engine (its real prefix cache and timing model, with salts from the gateway's own
`CacheSalts`) under each setting:

- `off`: one cache for all tenants (the timing side channel open);
- `tenant`: the gateway's default, each tenant its own cache;
- `group`: tenants in groups of `--group-size` share theirs.

Prints, per setting, the share of prompt tokens served from the prefix cache and the mean modelled
prefill time, each as a ratio against `off` in the same run.

    python -m kvplane.bench.cache_salt_bench [--tenants 8] [--requests 6] [--group-size 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.connector.simengine.engine import GenerationRequest, SimEngine
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.gateway.cache_salt import CacheSalts, Mode

SYSTEM_TOKENS = 1024
DOCUMENT_TOKENS = 512
QUESTION_TOKENS = 64


@dataclass(frozen=True)
class Outcome:
    mode: str
    cached_share: float
    prefill_s: float


def workload(tenants: int, requests: int, seed: int) -> list[tuple[str, list[int]]]:
    """(tenant, prompt) pairs, interleaved across tenants as they would arrive."""
    rnd = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rnd.randrange(300, 30_000) for _ in range(n)]

    system = tokens(SYSTEM_TOKENS)
    documents = {f"tenant-{t}": tokens(DOCUMENT_TOKENS) for t in range(tenants)}
    out = [
        (tenant, [*system, *documents[tenant], *tokens(QUESTION_TOKENS)])
        for _ in range(requests)
        for tenant in documents
    ]
    rnd.shuffle(out)
    return out


async def run(mode: Mode, turns: Sequence[tuple[str, list[int]]], group_size: int) -> Outcome:
    groups = {f"tenant-{t}": f"group-{t // group_size}" for t in range(len({t for t, _ in turns}))}
    salts = CacheSalts.create(mode, "bench-key", groups)
    # Time compressed 1000x for the run; the prefill times reported are the timing model's own.
    settings = SimEngineSettings(
        role="both",
        side_channel_port=0,
        num_blocks=1 << 14,
        bytes_per_block=4096,
        timing=TimingModel(speedup=1000.0),
    )
    engine = SimEngine(settings)
    await engine.start()
    cached = total = 0
    prefill: list[float] = []
    try:
        for i, (tenant, prompt) in enumerate(turns):
            request = GenerationRequest(
                request_id=f"r-{i}",
                prompt_token_ids=tuple(prompt),
                max_tokens=1,
                cache_salt=salts.salt(tenant),
            )
            hit = 0
            async for event in engine.generate(request):
                if event.finish is not None:
                    hit = event.finish.cached_tokens
            cached += hit
            total += len(prompt)
            # Uncompressed: the modelled time of a prefill of what the cache did not serve.
            prefill.append(settings.timing.prefill_s(len(prompt) - hit) * settings.timing.speedup)
    finally:
        await engine.stop()
    return Outcome(mode, cached / total, statistics.mean(prefill))


async def main_async(args: argparse.Namespace) -> None:
    turns = workload(args.tenants, args.requests, args.seed)
    outcomes = [await run(mode, turns, args.group_size) for mode in ("off", "tenant", "group")]
    base = outcomes[0]
    print(
        f"{len(turns)} requests from {args.tenants} tenants: {SYSTEM_TOKENS} shared system tokens, "
        f"{DOCUMENT_TOKENS} per-tenant document tokens, {QUESTION_TOKENS} own tokens each; "
        f"groups of {args.group_size}"
    )
    print(f"{'cache_salt':<10} {'cached share':>13} {'vs off':>7} {'prefill ms':>11} {'vs off':>7}")
    for o in outcomes:
        print(
            f"{o.mode:<10} {o.cached_share:>13.3f} {o.cached_share / base.cached_share:>7.2f} "
            f"{o.prefill_s * 1000:>11.1f} {o.prefill_s / base.prefill_s:>7.2f}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--requests", type=int, default=6, help="requests per tenant")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
