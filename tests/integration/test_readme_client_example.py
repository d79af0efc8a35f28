"""The README's `kvplane.services.client` example, run as written against a live stack:
Route → P → D → ReportTurn, and the next turn pulls what the first one left on D."""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvplane.services.dev.local_etcd import LocalEtcd
from tests.support.gateway_stack import MODEL, STACK_TOKENS, GatewayStack, gateway_stack

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    block = re.search(
        r"<!-- client-example:begin -->\n```python\n(.*?)```\n<!-- client-example:end -->", text, re.DOTALL
    )
    assert block is not None, "the README has no client example"
    return block.group(1)


@pytest.fixture
async def stack(etcd: LocalEtcd, tmp_path: Path) -> AsyncIterator[GatewayStack]:
    async with gateway_stack(etcd, f"/kvplane-readme/{uuid.uuid4().hex}/", tmp_path) as s:
        yield s


async def test_the_readme_client_example_routes_a_turn_and_the_next_one_pulls(stack: GatewayStack) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(readme_example(), str(README), "exec"), namespace)
    one_turn = namespace["one_turn"]
    routing = stack.routing_settings.grpc.listen
    token = STACK_TOKENS["gateway"]
    conversation = f"readme-{uuid.uuid4().hex[:8]}"
    request = {"model": MODEL, "prompt": "the history of caching " * 30, "max_tokens": 80, "ignore_eos": True}
    request["return_token_ids"] = True

    route, answer = await one_turn(routing, token, "acme", conversation, request, stack.prefill.url)
    assert route.decision == "recompute_no_handle"
    assert answer["usage"]["completion_tokens"] == 80
    assert "kv_transfer_params" not in answer
    handle = await stack.wait_handle("acme", conversation)

    rnd = random.Random(4)
    history = answer["choices"][0]["prompt_token_ids"] + answer["choices"][0]["token_ids"]
    follow_up = {**request, "prompt": history + [rnd.randrange(300, 30_000) for _ in range(40)]}
    route, answer = await one_turn(routing, token, "acme", conversation, follow_up, stack.prefill.url)
    assert route.decision == "pull"
    assert route.prefill_params["remote_request_id"]
    assert await stack.wait_handle("acme", conversation, other_than=handle)
