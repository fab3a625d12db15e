"""BlockManager: the paged KV block pool, block tables, reference counts and the prefix cache.

One block id indexes every (loop step, layer) KV plane (design contract 2), so a sequence needs a
single block table. Blocks are reference counted: sequences sharing a cached prefix (or the ``n``
completions of one request) hold the same blocks. A full block whose K/V has been computed is
registered under a chained hash ``hash((previous block's hash, its tokens))``; a later sequence
whose leading full blocks hash the same reuses them instead of recomputing (hits/misses are
counted in blocks). Freed blocks keep their contents and hash in an LRU free list until they are
handed out again, so a finished or preempted sequence's prefix stays reusable.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from rlt_compile.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())


@dataclass
class PrefixCacheStats:
    queries: int = 0  # admissions that looked the cache up
    hits: int = 0  # full blocks found
    misses: int = 0  # full blocks not found

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # chained hash -> block id
        self.stats = PrefixCacheStats()

    # -- pool ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> Block:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached contents
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free[block_id] = None

    # -- prefix cache --------------------------------------------------------------------------
    @staticmethod
    def chain_hash(previous: int | None, tokens: tuple[int, ...]) -> int:
        return hash((previous, tokens))

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Ids of the cached blocks holding the longest prefix of ``token_ids`` (full blocks only).

        At least one token is always left to compute (its logits are needed), so a fully cached
        sequence gives back its last matched block, which is recomputed into a fresh block rather
        than rewritten in place.
        """
        if not self.enable_prefix_caching:
            return []
        matched, previous, bs = [], None, self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            h = self.chain_hash(previous, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            matched.append(block_id)
            previous = h
        if matched and len(matched) * bs >= len(token_ids):
            matched.pop()
        return matched

    # -- per sequence --------------------------------------------------------------------------
    def can_admit(self, seq: Sequence, matched: list[int], num_new_tokens: int) -> bool:
        """Whether ``seq`` (no blocks yet) can take ``matched`` plus blocks for ``num_new_tokens`` more."""
        reused_free = sum(1 for b in matched if self.blocks[b].ref_count == 0)
        total = len(matched) * self.block_size + num_new_tokens
        needed = self.blocks_for(total) - len(matched)
        return needed + reused_free <= len(self.free)

    def admit(self, seq: Sequence, matched: list[int]) -> None:
        """Give ``seq`` the matched cached blocks; its computed tokens start after them."""
        assert not seq.block_table, f"{seq} already holds blocks"
        for block_id in matched:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        seq.block_table = list(matched)
        seq.block_hashes = [self.blocks[b].hash for b in matched]
        seq.num_computed_tokens = seq.num_cached_tokens = len(matched) * self.block_size
        if self.enable_prefix_caching:
            self.stats.queries += 1
            self.stats.hits += len(matched)
            self.stats.misses += len(seq) // self.block_size - len(matched)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` tokens in total."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free().block_id)

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that ``seq`` has filled and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, len(seq)) // bs
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self.chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached and block.hash is None:
                self.cached[h] = block.block_id
                block.hash, block.token_ids = h, tokens

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (tail first, so the prefix stays cached longest)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
