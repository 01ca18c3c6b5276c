"""The paged KV cache's bookkeeping (PagedAttention), in plain Python: no tensors here.

The KV cache is cut into `num_blocks` blocks of `block_size` slots. Token t of a request lives in
slot `block_table[t // block_size] * block_size + t % block_size`. That is the walkthrough's
slot_mapping (docs/walkthrough.md).

Invariants:
- Block 0 is the null block. It is never handed out, so 0 can pad a block table.
- A block is in the free queue iff its ref_cnt is 0. ref_cnt counts the block tables that hold it.
- Free blocks are handed out first-in first-out, and a freed block keeps its KV. If it is full and
  hashed, it stays findable in the prefix cache until it is handed out again (evicted). So the free
  queue is also the least-recently-used order of the cache.
- Prefix caching keys a full block by a SHA-256 hash chained over (parent block's hash, its tokens).
  So one key names the whole prefix up to and including that block. The key only finds a candidate.
  A hit is verified exactly, against the block's own tokens and its `parent`. The parent is the cached
  block before it, itself verified the same way. So a hit implies the whole prefix matches, even if two
  prefixes' keys collided. A crafted prompt can never be served another request's KV.
- A block is cached only after its parent. Sometimes a request's previous block is not the cached one,
  because someone else cached the same prefix first. Then the request caches none of its later blocks.
  So whoever holds a cached block also holds its parent. A child is freed, and so evicted, before its
  parent. A cached block's parent is always cached.
- A block is cached when the step that fills it is scheduled (as vLLM V1). So a request admitted later
  in the same step can share it. That is safe because every layer stores all of the step's k, v before
  any attention reads them, in whatever batch order (`Attention.forward`, attention.py).
  So "computed" means: its KV is in the cache, or this step stores it before anyone reads it.
  Every holder of a shared or cached block has computed it in that sense.
  A block is written by one request only. Its writer is never preempted in that step: the scheduler
  preempts only requests not yet scheduled, and admits no one in a step that preempted.
  A request may be freed with blocks it never computed (the step failed, and its requests are aborted).
  It uncaches them.
- Shared blocks are full, hence read-only once the step that fills them ran. A request only ever writes
  into its own last blocks.
- Sliding window (where every layer has one): a block every query to come has slid past is returned
  while its request runs (`free_passed_blocks`). Its entry in the block table becomes the null block 0.
  It stays cached until evicted, so a cached block may outlive its parent. A lookup stops at the
  missing parent.
`assert_invariants` checks all of this (tests call them after every step).
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from nanoserve.config import cdiv
from nanoserve.sequence import ScheduledSeq, Sequence


@dataclass
class Block:
    """One block of `block_size` KV slots: who uses it (ref_cnt) and, once full, what it holds."""
    block_id: int
    ref_cnt: int = 0
    hash: bytes | None = None                 # set by cache_full_blocks when the step filling it is scheduled
    token_ids: tuple[int, ...] | None = None  # the tokens behind `hash`, to verify a hit
    parent: int | None = None                 # the cached block before it (None: the first block)


def hash_block(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """The prefix-cache key of a full block: its tokens, chained to everything before them."""
    return hashlib.sha256(repr((parent_hash, token_ids)).encode()).digest()


class BlockManager:
    """Hands out, shares, frees and caches the KV blocks of every request."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # every layer's, if every layer has one: see free_passed_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # An OrderedDict as a queue that can also drop a block from its middle (a cache hit).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached_blocks: dict[int, int] = {}  # hash -> block_id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def num_free_slots(self, seq: Sequence) -> int:
        """How many more tokens seq can write without anyone freeing a block.
        That is the rest of its blocks plus every free block."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size - seq.num_computed_tokens

    def find_cached_prefix(self, seq: Sequence, max_tokens: int | None = None) -> list[int]:
        """The cached blocks that hold seq's leading full blocks, in order.
        They cover at most `max_tokens` tokens: the scheduler's limit for prompt logprobs, whose rows a hit
        would skip.

        Only blocks before the last token are looked up. The last token is always recomputed. So even a
        full hit leaves one token to run, which yields logits to sample from. Without prefix caching
        nothing is ever cached (cache_full_blocks), so nothing is found.
        """
        num_tokens = seq.num_tokens - 1 if max_tokens is None else min(seq.num_tokens - 1, max_tokens)
        hits = []  # block ids
        key = None
        for i in range(num_tokens // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            key = hash_block(key, tokens)
            block_id = self.cached_blocks.get(key)
            if block_id is None:
                break
            # The key only finds a candidate. Exact: the same tokens after the same (verified) block.
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent != (hits[-1] if hits else None):
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, num_tokens: int, cached_prefix: list[int] = (), reserve: int = 0) -> bool:
        """Grow seq's block table (append-only) to cover `num_tokens` slots.

        `cached_prefix` (from find_cached_prefix, for a request with no blocks yet) is shared
        first. Returns False, changing nothing, when that would leave fewer than `reserve` blocks free.
        """
        num_needed = cdiv(num_tokens, self.block_size) - len(seq.block_table) - len(cached_prefix)
        num_revived = sum(self.blocks[b].ref_cnt == 0 for b in cached_prefix)  # hits in the free queue
        if max(num_needed, 0) + num_revived + reserve > self.num_free_blocks:
            return False
        for block_id in cached_prefix:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        for _ in range(num_needed):
            block_id, _ = self.free_queue.popitem(last=False)
            self.evict(self.blocks[block_id])
            self.blocks[block_id].ref_cnt = 1
            seq.block_table.append(block_id)
        return True

    def free(self, seq: Sequence, num_tokens: int = 0) -> None:
        """Return seq's blocks past its first `num_tokens` slots.

        By default that is all of them: seq finished, was aborted or was preempted. Otherwise it is the
        blocks only rejected draft tokens used (spec_decode.py). Those are never shared nor cached, as no
        accepted token is in them. Its last blocks go to the queue first. They are the least likely to be
        shared, so they are evicted before the prefix they extend. A block cached for a step that never
        ran (it raised) holds no KV, so it leaves the cache."""
        while len(seq.block_table) > cdiv(num_tokens, self.block_size):
            block = self.blocks[seq.block_table.pop()]
            if block.block_id == 0:  # returned already: its sliding window had passed it (free_passed_blocks)
                continue
            # the block just popped holds slots [len(block_table) * block_size, (len(block_table) + 1) * block_size)
            if (len(seq.block_table) + 1) * self.block_size > seq.num_computed_tokens:  # not all computed
                self.evict(block)
            self.release(block)
        del seq.block_hashes[len(seq.block_table):]

    def free_passed_blocks(self, seq: Sequence) -> None:
        """Return the blocks every layer's sliding window has passed, while seq runs: its next query, at
        position num_computed_tokens, sees keys from num_computed_tokens - sliding_window + 1 on.
        Each passed block becomes the null block 0 in the table (later blocks keep their index) and stays
        cached until evicted. Last first: the queue then evicts a block before the prefix it extends."""
        i = (seq.num_computed_tokens - self.sliding_window + 1) // self.block_size - 1  # the last one wholly before it
        while i >= 0 and seq.block_table[i] != 0:  # the ones before a 0 were returned by an earlier step
            self.release(self.blocks[seq.block_table[i]])
            seq.block_table[i] = 0
            i -= 1

    def release(self, block: Block) -> None:
        """One block table lets go of `block`: the last one returns it to the free queue."""
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block.block_id] = None

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register in the prefix cache seq's blocks that are full once its first `num_tokens` are
        computed. Called when the step that computes them is scheduled (see the invariants)."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), num_tokens // self.block_size):  # the newly full blocks
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_hash = hash_block(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(block_hash)
            parent = seq.block_table[i - 1] if i > 0 else None
            if block_hash in self.cached_blocks or (parent is not None and self.blocks[parent].hash is None):
                continue  # this prefix is cached already, in other blocks: leave it to them
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids, block.parent = block_hash, tokens, parent
            self.cached_blocks[block_hash] = block.block_id

    def evict(self, block: Block) -> None:
        """Forget a block's cached contents: it is about to be overwritten."""
        if block.hash is not None:
            del self.cached_blocks[block.hash]
            block.hash = block.token_ids = block.parent = None

    def assert_invariants(self, seqs: list[Sequence], scheduled: list[ScheduledSeq] = ()) -> None:
        """Check the invariants above; raise AssertionError naming what broke.
        `seqs` is all the live requests. With no live request every block must be free: nothing leaked.

        `scheduled` is this step's plan, if it has not run yet. Each request writes the slots
        [num_computed_tokens, num_computed_tokens + num_new). They must lie in its blocks, and no block is
        written by two requests. Others may hold a block written now only if it is full after this step
        (they read it only after the step that writes it)."""
        # tokens computed by the end of this step, as the invariants mean it
        computed = {seq: seq.num_computed_tokens for seq in seqs}
        computed.update((seq, seq.num_computed_tokens + num_new) for seq, num_new in scheduled)
        holders = {}  # block_id -> [(seq, index in its block table)]
        for seq in seqs:
            assert len(seq.block_table) * self.block_size >= computed[seq], f"{seq} has KV without blocks"
            for i, block_id in enumerate(seq.block_table):
                if block_id != 0:  # 0: passed by a sliding window
                    holders.setdefault(block_id, []).append((seq, i))
        writers = {}  # block_id -> the request that writes it this step
        for seq, _ in scheduled:
            first, end = seq.num_computed_tokens // self.block_size, cdiv(computed[seq], self.block_size)
            for block_id in seq.block_table[first:end]:
                writer = writers.setdefault(block_id, seq)
                assert writer is seq, f"block {block_id} is written by {writer} and {seq}"
        assert 0 not in self.free_queue, "the null block 0 was freed"
        # Per block: free iff no block table holds it. So no block is lost, nor free and held at once.
        for block in self.blocks[1:]:
            held = holders.get(block.block_id, [])
            where = f"block {block.block_id} with ref_cnt {block.ref_cnt}, in {len(held)} block tables,"
            assert block.ref_cnt == len(held), f"{where} has a wrong ref_cnt"
            assert len({seq for seq, _ in held}) == len(held), f"{where} is held twice by one request"
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), f"{where} must be free iff unused"
            # Only a cache hit shares a block. A cached block is read-only: full, and computed (by the end
            # of this step) by every request that holds it; the first of them wrote it.
            assert len(held) < 2 or block.hash is not None, f"{where} is shared but not cached: nobody wrote it"
            assert block.hash is None or all((i + 1) * self.block_size <= computed[seq] for seq, i in held), \
                f"{where} is cached but not full and computed in {[seq for seq, _ in held]}"
        for block_hash, block_id in self.cached_blocks.items():
            block = self.blocks[block_id]
            assert block.hash == block_hash, f"the prefix cache maps {block_hash.hex()} to block {block_id}"
            # (a sliding window returns a parent before its children: a lookup then stops at the parent)
            assert block.parent is None or self.blocks[block.parent].hash is not None or self.sliding_window, \
                f"cached block {block_id} outlived its parent block {block.parent}"
