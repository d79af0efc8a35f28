"""A steady multi-turn load through both gateways: users each hold a streaming conversation
with token-id prompts, a new conversation every few turns.

A gateway that refuses the connection is skipped for the other one, as a load balancer
does; every turn that got an answer is recorded with when it ran and how it ended.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

from tests.chaos.cluster import API_KEY, MODEL

# Over vLLM's 64-token recompute threshold: the next turn pulls D's output rather than recomputing it.
MAX_TOKENS = 80


@dataclass
class TurnRecord:
    start: float
    end: float
    gateway: int
    ok: bool
    decision: str = ""
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Load:
    gateway_urls: list[str]
    users: int = 4
    turns_per_conversation: int = 6
    records: list[TurnRecord] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=60, sock_read=20)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._user(session, u, stop) for u in range(self.users)))

    async def _user(self, session: aiohttp.ClientSession, user: int, stop: asyncio.Event) -> None:
        rng = random.Random(user)
        turn = 0
        while not stop.is_set():
            conversation = f"chaos-{user}-{uuid.uuid4().hex[:8]}"
            # A long history: pulling it is worth more than recomputing it.
            prompt = [rng.randrange(1000, 30000) for _ in range(3000)]
            for _ in range(self.turns_per_conversation):
                if stop.is_set():
                    return
                output = await self._turn(session, conversation, prompt, turn % len(self.gateway_urls))
                turn += 1
                prompt = prompt + output + [rng.randrange(1000, 30000) for _ in range(40)]
                # Think time between turns, varied so that the users drift apart and turns keep
                # arriving while a fault lasts, not in waves of four.
                await asyncio.sleep(rng.uniform(0.1, 0.8))

    async def turn(
        self, session: aiohttp.ClientSession, conversation: str, prompt: list[int], first: int = 0
    ) -> list[int]:
        """One streamed turn, recorded; its output token ids, or [] if it failed."""
        return await self._turn(session, conversation, prompt, first)

    async def _turn(
        self, session: aiohttp.ClientSession, conversation: str, prompt: list[int], first: int
    ) -> list[int]:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {API_KEY}", "X-Conversation-Id": conversation}
        for attempt in range(len(self.gateway_urls)):
            index = (first + attempt) % len(self.gateway_urls)
            start = time.monotonic()
            try:
                return await self._stream(session, index, body, headers, start)
            except aiohttp.ClientConnectorError:
                continue  # nothing listens: the load balancer's next gateway
        self.records.append(
            TurnRecord(time.monotonic(), time.monotonic(), -1, False, error="no gateway answered")
        )
        return []

    async def _stream(
        self,
        session: aiohttp.ClientSession,
        index: int,
        body: dict[str, object],
        headers: dict[str, str],
        start: float,
    ) -> list[int]:
        record = TurnRecord(start, start, index, False)
        output: list[int] = []
        refused = False
        try:
            async with session.post(
                f"{self.gateway_urls[index]}/v1/completions", json=body, headers=headers
            ) as resp:
                record.decision = resp.headers.get("x-kvplane-decision", "")
                if resp.status != 200:
                    record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return []
                done = False
                async for line in resp.content:
                    text = line.decode().strip()
                    if not text.startswith("data: "):
                        continue
                    if text == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(text[6:])
                    if "error" in event:
                        record.error = f"error event: {event['error']}"
                        break
                    for choice in event.get("choices", []):
                        output.extend(choice.get("token_ids") or [])
                record.ok = done and not record.error
                if not done and not record.error:
                    record.error = "stream ended without [DONE]"
        except aiohttp.ClientConnectorError:
            refused = True
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            record.end = time.monotonic()
            if not refused:
                self.records.append(record)
        return output if record.ok else []
