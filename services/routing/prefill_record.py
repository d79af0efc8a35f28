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

Pure bookkeeping: no I/O, no clock reads. The routing service and the
simulator's `PolicyRouter` both keep one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvplane.connector import digests as token_digests
from kvplane.services.common.nodes import Node


@dataclass(frozen=True, slots=True)
class SentPrompt:
    """A prompt sent to a prefill node: its block chain (until its checkpoint digests are
    taken from it), or its length alone."""

    node_id: str
    tokens: int
    chain: Sequence[int] = ()
    block_size: int = 0
    digests: token_digests.TokenDigests | None = None

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

    def __len__(self) -> int:
        return len(self._by_conversation)

    def sent(
        self,
        conversation: Hashable,
        node: Node,
        prompt_tokens: int,
        block_chain: Sequence[int] = (),
        block_size: int = 0,
    ) -> None:
        """`node` was sent the conversation's prompt: it will hold its whole blocks."""
        entry = SentPrompt(node.node_id, prompt_tokens, block_chain if block_size > 0 else (), block_size)
        previous = self._by_conversation.pop(conversation, ())
        kept = [e for e in previous if e.node_id != node.node_id]
        for gone in kept[self.nodes_per_conversation - 1 :]:
            self._drop_from_node(conversation, gone.node_id)
        self._by_conversation[conversation] = (entry, *kept[: self.nodes_per_conversation - 1])
        self._hold(conversation, node, prompt_tokens)
        while len(self._by_conversation) > self.max_conversations:
            oldest, entries = self._by_conversation.popitem(last=False)
            for e in entries:
                self._drop_from_node(oldest, e.node_id)

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
            # Keep the checkpoints, not the chain: a few hundred bytes, whatever the prompt's length.
            proven.append(e if e.digests is digests else replace(e, chain=(), digests=digests))
            if digests is not None and block_chain and block_size == digests.block_size:
                blocks = token_digests.verified_prefix_blocks_from_chain(digests, block_chain)
                tokens = blocks * block_size
            elif digests is None and not e.chain and not block_chain:
                tokens = min(e.tokens, prompt_tokens)
            else:
                tokens = 0  # nothing to prove it with
            if tokens > 0:
                held[e.node_id] = tokens
        self._by_conversation[conversation] = tuple(proven)
        return held

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
