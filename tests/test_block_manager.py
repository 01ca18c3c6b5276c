"""The paged KV cache's bookkeeping on its own: allocation order, the null block, ref counts,
prefix-cache hits, LRU eviction, and that every block comes back."""
from nanoserve.block_manager import BlockManager
from nanoserve.sampler import SamplingParams
from nanoserve.sequence import Sequence

WALKTHROUGH_PROMPTS = [[1, 2, 3, 4, 5], [1, 6, 5, 7, 8, 9, 10], [1, 12, 13]]  # docs/walkthrough.md


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, None, tokens, SamplingParams())


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Allocate seq's whole prompt (with any cache hit), cache its full blocks and mark it
    computed, as scheduling one step and running it would."""
    hits = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens, hits)
    bm.cache_full_blocks(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens


def test_walkthrough_block_tables_skip_the_null_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    seqs = [make_seq(p) for p in WALKTHROUGH_PROMPTS]
    for seq in seqs:
        assert bm.allocate(seq, seq.num_tokens)
    assert [s.block_table for s in seqs] == [[1, 2], [3, 4], [5]]
    assert bm.num_free_blocks == 10 - 1 - 5
    assert bm.blocks[0].ref_cnt == 0 and 0 not in bm.free_queue


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=4, block_size=4)  # 3 usable blocks
    a, b = make_seq(list(range(8))), make_seq(list(range(100, 108)))
    assert bm.allocate(a, 8)
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate(a, 9)  # growing is append-only
    assert a.block_table == [1, 2, 3]


def test_free_returns_every_block_fifo():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_seq(list(range(8)), "a"), make_seq(list(range(4)), "b")
    bm.allocate(a, 8)
    bm.allocate(b, 4)
    bm.free(a)
    assert bm.num_free_blocks == 7 - 1
    assert all(bm.blocks[i].ref_cnt == 0 for i in (1, 2))
    c = make_seq(list(range(20)), "c")
    bm.allocate(c, 20)
    # never-used blocks first (first in, first out), then a's freed blocks, last block first
    assert c.block_table == [4, 5, 6, 7, 2]


def test_prefix_cache_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(50, 58))  # two full blocks shared by both prompts
    a, b = make_seq(system + [1, 2, 3], "a"), make_seq(system + [7, 8], "b")
    run_prefill(bm, a)
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    run_prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_cnt for i in a.block_table] == [2, 2, 1]


def test_last_token_is_always_recomputed():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(8)), "a")
    run_prefill(bm, a)
    # The same 8 tokens again: only the first block may hit, so token 7 still runs.
    assert bm.find_cached_prefix(make_seq(list(range(8)), "b")) == a.block_table[:1]


def test_hash_is_chained_over_the_prefix():
    bm = BlockManager(num_blocks=16, block_size=2)
    run_prefill(bm, make_seq([1, 2, 3, 4, 5], "a"))
    # Block [3, 4] is cached, but only after [1, 2]: a different first block means no hit at all.
    assert bm.find_cached_prefix(make_seq([9, 9, 3, 4, 5], "b")) == []


def test_a_hash_collision_is_verified_away(monkeypatch):
    import nanoserve.block_manager as block_manager
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens: b"42")  # everything collides
    bm = BlockManager(num_blocks=16, block_size=2)
    run_prefill(bm, make_seq([1, 2, 3], "a"))
    assert bm.find_cached_prefix(make_seq([5, 6, 7], "b")) == []


def test_a_forged_key_never_serves_another_prefix(monkeypatch):
    """A key that ignores a block's first token lets [9, 2] and [1, 2] collide. Request b, whose first
    block collided with a's, computes its second block [3, 4] after [9, 2]; a hit for [1, 2, 3, 4]
    must not take that KV, although its key and its own tokens match (the bug: only the block's own
    tokens were checked, so a crafted prompt was served another request's KV)."""
    import nanoserve.block_manager as block_manager
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens: repr((parent, tokens[1:])).encode())
    bm = BlockManager(num_blocks=16, block_size=2)
    a, b = make_seq([1, 2, 7, 7, 0], "a"), make_seq([9, 2, 3, 4, 0], "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    assert bm.find_cached_prefix(b) == []  # b's own first block lost to a's: nothing of b is cached
    bm.assert_invariants([a, b])
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 0], "c")) == a.block_table[:1]


def test_a_hit_must_follow_its_own_parent(monkeypatch):
    """Keys that ignore the parent: [3, 4] after [1, 2] and [3, 4] after [5, 6] share one key. A hit
    for [5, 6, 3, 4] finds the block computed after [1, 2]: its tokens match, its parent does not."""
    import nanoserve.block_manager as block_manager
    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens: repr(tokens).encode())
    bm = BlockManager(num_blocks=16, block_size=2)
    a, b = make_seq([1, 2, 3, 4, 0], "a"), make_seq([5, 6, 7, 7, 0], "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    assert bm.find_cached_prefix(make_seq([5, 6, 3, 4, 0], "c")) == b.block_table[:1]


def test_a_cached_block_is_evicted_before_its_parent():
    bm = BlockManager(num_blocks=6, block_size=2)  # 5 usable blocks
    a = make_seq([1, 2, 3, 4, 5], "a")
    run_prefill(bm, a)                    # blocks 1 [1, 2], 2 [3, 4] cached, 3 [5]
    b = make_seq([1, 2, 8], "b")
    run_prefill(bm, b)                    # shares block 1 only
    bm.free(a)
    bm.free(b)                            # block 1 is freed last, after its child 2
    c = make_seq(list(range(20, 25)), "c")
    run_prefill(bm, c)                    # takes 3 blocks: 4, 5, then the least recently freed, 2
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 9], "d")) == [1]
    bm.assert_invariants([c])


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=5, block_size=2)  # 4 usable blocks
    a = make_seq([1, 2, 3, 4, 5], "a")
    run_prefill(bm, a)                 # blocks 1 [1,2], 2 [3,4], 3 [5]
    bm.free(a)
    assert bm.num_free_blocks == 4     # cached blocks count as free
    b = make_seq([1, 2, 3, 4, 9], "b")
    assert bm.find_cached_prefix(b) == [1, 2]   # still there after free
    run_prefill(bm, b)
    assert b.block_table[:2] == [1, 2] and bm.num_free_blocks == 1
    bm.free(b)
    # Eviction takes the least recently freed blocks first: fill the cache with new tokens.
    c = make_seq(list(range(100, 107)), "c")
    run_prefill(bm, c)                 # takes all 4 blocks, so everything cached is evicted
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 9], "d")) == []
    assert all(bm.blocks[i].ref_cnt == 1 for i in c.block_table)


def test_revived_cached_blocks_count_against_free_space():
    bm = BlockManager(num_blocks=4, block_size=2)  # 3 usable blocks
    a = make_seq([1, 2, 3, 4, 5], "a")
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 6, 7, 8], "b")      # needs 4 blocks: 2 hits + 2 new
    hits = bm.find_cached_prefix(b)
    assert hits == [1, 2]
    assert not bm.allocate(b, b.num_tokens, hits)
    assert b.block_table == [] and bm.num_free_blocks == 3
    assert all(bm.blocks[i].ref_cnt == 0 for i in range(1, 4))


def test_no_prefix_caching_means_no_hits():
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=False)
    run_prefill(bm, make_seq([1, 2, 3, 4, 5], "a"))
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5], "b")) == []
