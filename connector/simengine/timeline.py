"""The engine's recent requests, timed: when each arrived, gave its first token and finished.

A benchmark joins them with its own turns by the prompt's digest, to split a turn's TTFT into the
time the engines spent on it and the time the front between client and engines added. Times are
`time.perf_counter()`: CLOCK_MONOTONIC on Linux, one clock for every process on the host.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# Requests kept: a comparison block reads them as soon as it ends, well before this many more.
CAPACITY = 16384


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A prompt's digest: the same for the same token ids, in every process."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class TimedRequest:
    seq: int  # 1, 2, ... in the order the requests finished
    digest: str
    arrived: float
    first_token: float
    finished: float


class Timeline:
    """The last `capacity` finished requests, oldest first."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._requests: deque[TimedRequest] = deque(maxlen=capacity)
        self._seq = 0

    @property
    def last_seq(self) -> int:
        return self._seq

    def record(self, prompt: Sequence[int], arrived: float, first_token: float, finished: float) -> None:
        self._seq += 1
        self._requests.append(TimedRequest(self._seq, prompt_digest(prompt), arrived, first_token, finished))

    def since(self, seq: int) -> list[TimedRequest]:
        """The requests kept that finished after request `seq`, oldest first."""
        return [r for r in self._requests if r.seq > seq]
