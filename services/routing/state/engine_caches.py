"""What each prefill node's prefix cache holds, as its own engine's KV-cache events show it.

Each node agent reads its engine's events (`kvplane.connector.kv_events`) and streams the block
ids its engine holds to every routing replica (`RoutingService.StreamPrefixCache`): a snapshot
on every (re)connect, then coalesced deltas at most every 100 ms, and a keep-alive at least
every 0.5 s when nothing changed. This is the replica's copy: per node, the incarnation and hash
configuration the stream named, the block ids, and when it last heard from the node.

A prompt's prefix on a node is then exact: its block ids are predicted from its token ids, the
tenant's `cache_salt` and the node's hash configuration (`BlockHasher`), and the prefix held is
the longest run of them, from the first block, that the node holds. vLLM matches its cache the
same way, and stops at the first block it lacks. A node that sends only checkpoint blocks (every
k-th depth) is matched at its checkpoints: the prefix is then exact to k blocks, never more.

A view is used only while it is *fresh*: its snapshot complete, a message heard within
`stale_after_s`, and its incarnation the node's registered one. Otherwise `cached_tokens` says
None, and the router falls back to its own record (`prefill_record`). Believing a node holds
too much costs time, never correctness: a pull is proven by its digests, vLLM matches its cache
by hash.

Memory is bounded: `max_nodes` views (the least recently heard goes first), `max_blocks` per
node (a view that outgrows it is dropped until the node's next snapshot). Pure: no I/O, time is
an argument (monotonic seconds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvplane.services.common.model.block_hashes import BlockHasher, UnknownHashAlgo
from kvplane.services.routing.policy.snapshot import Prompt
from kvplane.services.routing.state.prompt_hashes import HashWalk, PromptHashes


@dataclass(frozen=True, slots=True)
class HashConfig:
    """How a node's engine hashes its blocks."""

    block_size: int
    algo: str
    seed: str
    # The node sends blocks at every `checkpoint_blocks`-th depth only.
    checkpoint_blocks: int = 1


@dataclass(frozen=True, slots=True)
class CacheUpdate:
    """One message of a node's stream, as domain values."""

    node_id: str
    incarnation: str
    config: HashConfig
    snapshot: bool
    stored: Sequence[int] = ()
    removed: Sequence[int] = ()
    # More parts of this snapshot follow.
    snapshot_continues: bool = False


@dataclass(slots=True)
class _View:
    incarnation: str
    config: HashConfig
    blocks: set[int] = field(default_factory=set)
    heard_s: float = 0.0
    complete: bool = False


@dataclass(slots=True)
class EngineCachesStats:
    updates: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    # Views dropped for holding more than max_blocks.
    overflows: int = 0
    # Updates not applied: a delta with no snapshot before it, or an unpredictable hash config.
    rejected: int = 0


class EngineCaches:
    """Per node, the block ids its engine's events say it holds."""

    def __init__(
        self, *, stale_after_s: float = 2.0, max_nodes: int = 10_000, max_blocks: int = 4_000_000
    ) -> None:
        if stale_after_s <= 0 or max_nodes <= 0 or max_blocks <= 0:
            raise ValueError("stale_after_s, max_nodes and max_blocks must be positive")
        self.stale_after_s = stale_after_s
        self.max_nodes = max_nodes
        self.max_blocks = max_blocks
        self.stats = EngineCachesStats()
        self._views: OrderedDict[str, _View] = OrderedDict()
        self._hashers: dict[tuple[int, str, str], BlockHasher] = {}
        self._prompt_hashes = PromptHashes()

    def __len__(self) -> int:
        return len(self._views)

    def apply(self, update: CacheUpdate, now_s: float) -> bool:
        """Applies one message; False when it could not be (then the view is not used)."""
        view = self._views.get(update.node_id)
        if update.snapshot:
            if self._hasher(update.config) is None:
                self.stats.rejected += 1
                self._views.pop(update.node_id, None)
                return False
            view = _View(update.incarnation, update.config)
            self._views[update.node_id] = view
        elif view is None or view.incarnation != update.incarnation or view.config != update.config:
            # A delta against a snapshot this replica does not hold: wait for the next snapshot.
            self.stats.rejected += 1
            return False
        self.stats.updates += 1
        view.heard_s = now_s
        self._views.move_to_end(update.node_id)
        blocks = view.blocks
        blocks.difference_update(update.removed)
        blocks.update(update.stored)
        self.stats.blocks_removed += len(update.removed)
        self.stats.blocks_stored += len(update.stored)
        if update.snapshot or not view.complete:
            view.complete = not update.snapshot_continues
        if len(blocks) > self.max_blocks:
            self.stats.overflows += 1
            del self._views[update.node_id]
            return False
        while len(self._views) > self.max_nodes:
            self._views.popitem(last=False)
        return True

    def forget(self, node_id: str) -> None:
        self._views.pop(node_id, None)

    def fresh(self, node_id: str, incarnation: str, now_s: float) -> bool:
        """Whether the node's view may replace the router's record for it."""
        view = self._views.get(node_id)
        return (
            view is not None
            and view.complete
            and view.incarnation == incarnation
            and now_s - view.heard_s <= self.stale_after_s
        )

    def blocks(self, node_id: str) -> int:
        """Block ids the node's view holds (0: none, or no view)."""
        view = self._views.get(node_id)
        return len(view.blocks) if view is not None else 0

    def block_counts(self) -> dict[str, int]:
        """Block ids each node's view holds, by node id (nodes without a view are absent)."""
        return {node_id: len(view.blocks) for node_id, view in self._views.items()}

    def cached_tokens(
        self,
        nodes: Iterable[tuple[str, str]],
        token_ids: Sequence[int],
        cache_salt: str | None,
        now_s: float,
        conversation: Hashable | None = None,
    ) -> Mapping[str, int]:
        """For each (node id, incarnation) with a fresh view: the tokens of the prompt's prefix it
        holds, as vLLM would find it (whole blocks, never the prompt's last token; 0: none). Nodes
        without a fresh view are absent. With `conversation`, the hashes its previous prompt had
        are reused where the tokens agree (`prompt_hashes`)."""
        by_config: dict[HashConfig, list[tuple[str, set[int]]]] = {}
        for node_id, incarnation in nodes:
            if self.fresh(node_id, incarnation, now_s):
                view = self._views[node_id]
                by_config.setdefault(view.config, []).append((node_id, view.blocks))
        held: dict[str, int] = {}
        for config, views in by_config.items():
            hasher = self._hasher(config)
            if hasher is None:
                continue
            usable = max(0, len(token_ids) - 1) // config.block_size
            if conversation is None:
                walk = HashWalk(hasher, token_ids, cache_salt)
            else:
                walk = self._prompt_hashes.walk(conversation, hasher, token_ids, cache_salt)
            held.update(_prefix_blocks(walk, config.checkpoint_blocks, views, usable))
            if conversation is not None:
                self._prompt_hashes.keep(conversation, walk, cache_salt)
        return held

    def prefix_tokens(
        self,
        nodes: Iterable[tuple[str, str]],
        prompt: Prompt,
        cache_salt: str | None,
        now_s: float,
        conversation: Hashable | None = None,
    ) -> Mapping[str, int]:
        """`cached_tokens` for a prompt whose token ids are known; nothing for one without."""
        if not prompt.token_ids:
            return {}
        return self.cached_tokens(nodes, prompt.token_ids, cache_salt, now_s, conversation)

    def forget_conversation(self, conversation: Hashable) -> None:
        self._prompt_hashes.forget(conversation)

    def _hasher(self, config: HashConfig) -> BlockHasher | None:
        key = (config.block_size, config.algo, config.seed)
        hasher = self._hashers.get(key)
        if hasher is None:
            try:
                hasher = BlockHasher(config.block_size, config.algo, config.seed)
            except (UnknownHashAlgo, ValueError):
                return None
            if len(self._hashers) < 64:
                self._hashers[key] = hasher
        return hasher


def _prefix_blocks(
    walk: HashWalk, k: int, views: list[tuple[str, set[int]]], usable_blocks: int
) -> dict[str, int]:
    """Tokens of the prompt's leading blocks each view holds (a view of every k-th block: at its
    checkpoints), hashing no further than some view holds (in growing chunks)."""
    held: dict[str, int] = {}
    for node_id, blocks in views:
        matched, depth, chunk = 0, k, 16 * k
        while depth <= usable_blocks:
            upto = min(usable_blocks, depth + chunk)
            walk.block_id(upto)  # computes the ids through `upto`
            ids = walk.ids
            missing = next((d for d in range(depth, upto + 1, k) if ids[d - 1] not in blocks), 0)
            if missing:
                matched = missing - k
                break
            matched = upto - upto % k
            depth, chunk = matched + k, chunk * 2
        held[node_id] = matched * walk.hasher.block_size
    return held
