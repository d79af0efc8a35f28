"""What each prefill node's prefix cache probably holds, from what this router sent it.

vLLM's prefill engine keeps the KV of the prompts it computed (or pulled) in
its prefix cache and uses it before anything else: a turn routed back to the
node that served the conversation's previous turn computes only what that
node lacks. Engines do not report their prefix cache to kvplane, so the
router keeps its own record: for each conversation, the prompts it last sent
to a few prefill nodes, as chained block digests at checkpoints (about 700
bytes for 32k tokens). A new prompt is checked against them, so only a
prefix the prompt really shares counts. The checkpoints are taken from the
prompt's chain when first needed (the conversation's next turn), so a
prompt chain that is hashed lazily (`prompt_chains`) is not hashed for this.

It is a hint: the node may have evicted the blocks since (the record drops
a node's oldest prompts once they add up to more than its KV capacity, as
an LRU cache would), or another router may have sent it other work. A wrong
hint costs time, never correctness: vLLM matches its cache by token hashes.

P corrects it on every turn. Each node has a clock of the tokens it was
sent that it did not hold (what its cache had to take in), and each prompt
recorded on it the clock's value then: its age. P's report of a turn (its
prefix-cache hits) says whether the prompt recorded before was still held
at that age. A miss shows the cache holds less than age + prompt (running
requests take blocks too, other routers fill it, prefix caching may be
off, the engine may have restarted); a hit that the record did not count
on shows it holds more. The node's effective capacity is set from that
evidence at once, and a prompt counts as held only while its age plus its
own tokens fit in it. So the record stays an LRU, of the size P's reports
show, not of the size P registered.

Pure bookkeeping: no I/O, no clock reads. The routing service and the
simulator's `PolicyRouter` both keep one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvplane.connector import digests as token_digests
from kvplane.services.common.model.nodes import Node


@dataclass(frozen=True, slots=True)
class SentPrompt:
    """A prompt sent to a prefill node: its block chain (until its checkpoint digests are
    taken from it), or its length alone."""

    node_id: str
    tokens: int
    chain: Sequence[int] = ()
    block_size: int = 0
    digests: token_digests.TokenDigests | None = None
    # The node's clock of tokens taken in (`PrefillCacheRecord`) when this prompt was sent.
    sent_at: int = 0
    # The node's clock of prompt tokens sent to it, cached or not, once this prompt was.
    touched_at: int = 0
    # Tokens the conversation's latest prompt was found to share with this one (`cached_tokens`),
    # -1 before any was checked.
    shared_with_next: int = -1

    def proof(self) -> token_digests.TokenDigests | None:
        """The checkpoint digests, None when the prompt was sent by length (or its chain was lost)."""
        if self.digests is None and self.chain and self.block_size > 0:
            try:
                return prompt_digests(self.chain, self.block_size)
            except LookupError:
                return None
        return self.digests


def prompt_digests(block_chain: Sequence[int], block_size: int) -> token_digests.TokenDigests:
    """Checkpoint digests of a prompt from its full block chain (no hashing)."""
    # One pass over the chain (a lazy chain hashes, or hands over, all its values at once), then
    # plain tuple indexing for each checkpoint.
    chain = tuple(block_chain)
    points = token_digests.checkpoints(len(chain))
    return token_digests.TokenDigests(block_size, len(chain), tuple(chain[p - 1] for p in points))


@dataclass(frozen=True, slots=True)
class SentReceipt:
    """What the record held for a route's prefill node when the prompt was sent: kept with the route
    until P reports the turn (`PrefillCacheRecord.observed`)."""

    node_id: str
    # The conversation's prompt recorded on the node before (0: none), its age then in tokens
    # taken in since, the tokens the new prompt shares with it, and of those the tokens the
    # record believed the node still held.
    previous_tokens: int
    age_tokens: int
    shared_tokens: int
    believed_tokens: int
    # The prompt tokens of other turns the node was sent since the conversation's previous
    # prompt, whether it held them or not: each touch moves a cached block to the young end of
    # vLLM's LRU, so these, not the intake alone, push the conversation's blocks towards eviction.
    touched_tokens: int = 0


class PrefillCacheRecord:
    """Per conversation, the last prompts sent to up to `nodes_per_conversation` prefill nodes."""

    def __init__(self, *, max_conversations: int = 100_000, nodes_per_conversation: int = 2) -> None:
        if max_conversations <= 0 or nodes_per_conversation <= 0:
            raise ValueError("max_conversations and nodes_per_conversation must be positive")
        self.max_conversations = max_conversations
        self.nodes_per_conversation = nodes_per_conversation
        self._by_conversation: OrderedDict[Hashable, tuple[SentPrompt, ...]] = OrderedDict()
        # Per node, the conversations whose prompt it holds, oldest first, with their tokens.
        self._by_node: dict[str, OrderedDict[Hashable, int]] = {}
        self._node_tokens: dict[str, int] = {}
        # Per node: the tokens it was sent that it did not hold (a clock), every prompt token it
        # was sent (a clock), and the capacity in tokens its reports show (absent: not learned
        # yet; bounded by what it registered).
        self._taken_in: dict[str, int] = {}
        self._touched: dict[str, int] = {}
        self._capacity: dict[str, int] = {}
        # Nodes whose latest report showed their prefix cache keeping a prompt the record
        # believed held (a miss since takes a node out).
        self._keeping: set[str] = set()
        # Misses per node, and the nodes that ever reported a prefix-cache hit: a node with
        # misses (more than one: a single one may be an eviction) and never a hit has no prefix
        # cache, or none that keeps anything from one turn to the next.
        self._misses: dict[str, int] = {}
        self._hit: set[str] = set()

    def __len__(self) -> int:
        return len(self._by_conversation)

    def sent(
        self,
        conversation: Hashable,
        node: Node,
        prompt_tokens: int,
        block_chain: Sequence[int] = (),
        block_size: int = 0,
    ) -> SentReceipt:
        """`node` was sent the conversation's prompt: it will hold its whole blocks.

        The receipt goes back to `observed` with P's report of the turn."""
        node_id = node.node_id
        previous = self._by_conversation.pop(conversation, ())
        before = next((e for e in previous if e.node_id == node_id), None)
        clock = self._taken_in.get(node_id, 0)
        if before is None:
            receipt = SentReceipt(node_id, 0, 0, 0, 0)
        else:
            shared = before.shared_with_next
            if shared < 0:
                shared = min(before.tokens, prompt_tokens)
            held = min(shared, self._still_held(before))
            touched = self._touched.get(node_id, 0) - before.touched_at
            receipt = SentReceipt(node_id, before.tokens, clock - before.sent_at, shared, held, touched)
        # What the node's cache takes in: the prompt but for what it is believed to hold.
        clock += max(0, prompt_tokens - receipt.believed_tokens)
        self._taken_in[node_id] = clock
        touched_at = self._touched.get(node_id, 0) + prompt_tokens
        self._touched[node_id] = touched_at
        entry = SentPrompt(
            node_id,
            prompt_tokens,
            block_chain if block_size > 0 else (),
            block_size,
            sent_at=clock,
            touched_at=touched_at,
        )
        kept = [e for e in previous if e.node_id != node.node_id]
        for gone in kept[self.nodes_per_conversation - 1 :]:
            self._drop_from_node(conversation, gone.node_id)
        self._by_conversation[conversation] = (entry, *kept[: self.nodes_per_conversation - 1])
        self._hold(conversation, node, prompt_tokens)
        while len(self._by_conversation) > self.max_conversations:
            oldest, entries = self._by_conversation.popitem(last=False)
            for e in entries:
                self._drop_from_node(oldest, e.node_id)
        return receipt

    def observed(self, node: Node, receipt: SentReceipt, cached_tokens: int, block_size: int) -> None:
        """P reported the turn: `cached_tokens` of its prompt came from its own prefix cache.

        Compared with what the node was believed to hold of the conversation's previous prompt at
        its age, the report bounds the node's effective capacity from above (a miss) or below (a
        hit), at once. A prompt that was not recorded on the node says nothing."""
        if receipt.node_id != node.node_id:
            return
        node_id = node.node_id
        if cached_tokens >= max(1, block_size):
            self._hit.add(node_id)
        if receipt.shared_tokens <= 0:
            return
        registered = _capacity_tokens(node)
        cached = max(0, cached_tokens)
        # P counts whole blocks only, and computes a prompt's last token itself.
        slack = max(1, block_size)
        # vLLM evicts a prompt's blocks tail first: `cached` of it were left at that age.
        shown = receipt.age_tokens + cached
        if cached + slack <= receipt.shared_tokens:
            # Evicted (or never cached) by that age: the cache holds that much, no more.
            self._capacity[node_id] = shown
            self._keeping.discard(node_id)
            self._misses[node_id] = self._misses.get(node_id, 0) + 1
            return
        if receipt.believed_tokens > 0:
            self._keeping.add(node_id)
        if receipt.believed_tokens + slack <= cached:
            # Held though the record had given it up: the cache holds at least that.
            grown = max(self._capacity.get(node_id, 0), shown)
            self._capacity[node_id] = min(grown, registered) if registered > 0 else grown

    def keeps_until_next_turn(self, node: Node, receipt: SentReceipt, prompt_tokens: int) -> bool:
        """Whether `node` is expected to still hold this prompt at the conversation's next turn.

        Only a node whose reports show its prefix cache keeping prompts from one turn to the
        next is trusted, and only for a conversation it served last turn (`receipt`): until the
        next turn it is sent, at most, twice the prompt tokens it was sent between the last two
        (`SentReceipt.touched_tokens`: held or not, each moves its blocks ahead of this prompt's
        in the LRU), and the prompt must fit in its capacity behind those.
        """
        node_id = node.node_id
        if node_id not in self._keeping or receipt.node_id != node_id or receipt.shared_tokens <= 0:
            return False
        capacity = self._capacity.get(node_id) or _capacity_tokens(node)
        behind = max(receipt.touched_tokens, receipt.age_tokens)
        return capacity > 0 and prompt_tokens + 2 * behind <= capacity

    def shows_keeping(self, node_id: str) -> bool:
        """Whether the node's latest report showed its prefix cache keeping a prompt the record
        believed held: its beliefs are then proven, not guessed."""
        return node_id in self._keeping

    def capacity_tokens(self, node_id: str) -> int | None:
        """The node's effective capacity its reports show, None until they show one."""
        return self._capacity.get(node_id)

    def forget(self, conversation: Hashable) -> None:
        for e in self._by_conversation.pop(conversation, ()):
            self._drop_from_node(conversation, e.node_id)

    def cached_tokens(
        self,
        conversation: Hashable,
        prompt_tokens: int,
        block_chain: Sequence[int] = (),
        block_size: int = 0,
    ) -> Mapping[str, int]:
        """Tokens of this prompt each node is believed to hold, by node id (absent: none).

        With the prompt's block chain the shared prefix is proven against the
        recorded digests; with its length alone, a recorded prompt of the
        conversation is assumed to be a prefix of the new one.
        """
        entries = self._by_conversation.get(conversation)
        if not entries:
            return {}
        held: dict[str, int] = {}
        proven: list[SentPrompt] = []
        for e in entries:
            digests = e.proof()
            if digests is not None and block_chain and block_size == digests.block_size:
                blocks = token_digests.verified_prefix_blocks_from_chain(digests, block_chain)
                tokens = blocks * block_size
            elif digests is None and not e.chain and not block_chain:
                tokens = min(e.tokens, prompt_tokens)
            else:
                tokens = 0  # nothing to prove it with
            # Keep the checkpoints, not the chain: a few hundred bytes, whatever the prompt's length.
            if e.digests is digests and e.shared_with_next == tokens:
                proven.append(e)  # unchanged: no copy on Route's path
            elif e.digests is digests:
                proven.append(replace(e, shared_with_next=tokens))
            else:
                proven.append(replace(e, chain=(), digests=digests, shared_with_next=tokens))
            tokens = min(tokens, self._still_held(e))
            if tokens > 0:
                held[e.node_id] = tokens
        self._by_conversation[conversation] = tuple(proven)
        return held

    def _still_held(self, entry: SentPrompt) -> int:
        """Tokens of `entry` the node's effective capacity still holds at its age (LRU order).

        A node that missed more than once and never reported a hit holds nothing: a miss only
        bounds the capacity by the age it was seen at, which on a busy node stays large even
        where the cache keeps nothing at all (prefix caching off).
        """
        if self._misses.get(entry.node_id, 0) > 1 and entry.node_id not in self._hit:
            return 0
        capacity = self._capacity.get(entry.node_id)
        if capacity is None:
            return entry.tokens
        age = self._taken_in.get(entry.node_id, 0) - entry.sent_at
        return max(0, min(entry.tokens, capacity - age))

    def _hold(self, conversation: Hashable, node: Node, tokens: int) -> None:
        node_id = node.node_id
        self._drop_from_node(conversation, node_id)
        held = self._by_node.setdefault(node_id, OrderedDict())
        held[conversation] = tokens
        self._node_tokens[node_id] = self._node_tokens.get(node_id, 0) + tokens
        capacity = _capacity_tokens(node)
        # The node's cache is an LRU: its oldest prompts go first once they overflow it.
        while capacity and self._node_tokens[node_id] > capacity and len(held) > 1:
            oldest = next(iter(held))
            self._drop_from_node(oldest, node_id)
            self._drop_entry(oldest, node_id)

    def _drop_from_node(self, conversation: Hashable, node_id: str) -> None:
        held = self._by_node.get(node_id)
        if held is None:
            return
        tokens = held.pop(conversation, None)
        if tokens is not None:
            self._node_tokens[node_id] -= tokens
        if not held:
            del self._by_node[node_id]
            self._node_tokens.pop(node_id, None)

    def _drop_entry(self, conversation: Hashable, node_id: str) -> None:
        entries = self._by_conversation.get(conversation)
        if entries is None:
            return
        left = tuple(e for e in entries if e.node_id != node_id)
        if left:
            self._by_conversation[conversation] = left
        else:
            del self._by_conversation[conversation]


def _capacity_tokens(node: Node) -> int:
    """The node's KV capacity in tokens, 0 when it did not say."""
    if node.kv_capacity_bytes <= 0 or node.kv_bytes_per_token <= 0:
        return 0
    return node.kv_capacity_bytes // node.kv_bytes_per_token
