"""A size-bounded mapping that forgets the least recently written entries."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedMap(Generic[K, V]):
    """Insertion-ordered dict capped at `limit` entries; a write refreshes an entry."""

    def __init__(self, limit: int, on_evict: Callable[[K, V], None] | None = None) -> None:
        """`on_evict` is told of each entry forgotten for the cap (not of a `pop`)."""
        self.limit = limit
        self._items: OrderedDict[K, V] = OrderedDict()
        self._on_evict = on_evict

    def put(self, key: K, value: V) -> None:
        if self.limit <= 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.limit:
            evicted, value = self._items.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(evicted, value)

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def pop(self, key: K) -> V | None:
        return self._items.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
