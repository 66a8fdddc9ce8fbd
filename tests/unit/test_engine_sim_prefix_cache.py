"""Block hashes and the bounded prefix cache."""

from __future__ import annotations

from engine_sim.block_hash import HASH_MASK_64, BlockHashMemo, hash_prompt_blocks
from engine_sim.cache_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from engine_sim.prefix_cache import PrefixCache, PublishCursor
from router.kvhash.vllm import event_hash, hash_block_tokens, none_hash, sha256_pickle

BS = 4


def test_block_hashes_chain_and_share_prefixes() -> None:
    a = hash_prompt_blocks(list(range(10)), BS)
    b = hash_prompt_blocks([*range(8), 99, 98, 97, 96], BS)
    assert len(a) == 2  # the partial tail (2 tokens) is not a block
    assert len(b) == 3
    assert a[:2] == b[:2]
    first = hash_block_tokens(sha256_pickle, none_hash("sha256", "0"), [0, 1, 2, 3])
    assert a[0] == event_hash(first)
    assert a[1] == event_hash(hash_block_tokens(sha256_pickle, first, [4, 5, 6, 7]))
    assert all(0 <= h <= HASH_MASK_64 for h in a + b)


def test_block_hash_depends_on_parent_salt_and_seed() -> None:
    tokens = list(range(8))
    plain = hash_prompt_blocks(tokens, BS)
    salted = hash_prompt_blocks(tokens, BS, cache_salt="s")
    seeded = hash_prompt_blocks(tokens, BS, seed="other")
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt changes the whole chain
    assert plain[0] != seeded[0]
    assert hash_prompt_blocks(tokens, BS, algo="xxhash")[0] != plain[0]


def test_match_acquire_release_and_hits() -> None:
    events: list[CacheEvent] = []
    cache = PrefixCache(capacity_blocks=8, block_size=BS, on_event=events.append)
    tokens = list(range(12))
    hashes = hash_prompt_blocks(tokens, BS)
    assert cache.match(hashes) == 0
    lease = cache.acquire(hashes, tokens)
    assert lease.block_hashes == tuple(hashes)
    assert len(set(lease.block_ids)) == 3 and 0 not in lease.block_ids
    assert events == [BlockStored(tuple(hashes), None, tuple(tokens), BS)]
    assert cache.num_in_use == 3 and cache.usage() == 3 / 8
    cache.release(lease)
    assert cache.num_in_use == 0 and cache.num_cached == 3
    assert cache.match(hashes) == 3
    other = hash_prompt_blocks([*range(8), 50, 51, 52, 53], BS)
    assert cache.match(other) == 2
    events.clear()
    lease2 = cache.acquire(other, [*range(8), 50, 51, 52, 53])
    assert lease2.block_ids[:2] == lease.block_ids[:2]
    assert events == [BlockStored((other[2],), other[1], (50, 51, 52, 53), BS, first_block=2)]


def _served(first: list[int], capacity: int = 3
            ) -> tuple[PrefixCache, list[CacheEvent], list[int]]:
    """A cache of `capacity` blocks that held `first` and let it go: (cache, its events,
    its hashes)."""
    events: list[CacheEvent] = []
    cache = PrefixCache(capacity_blocks=capacity, block_size=BS, on_event=events.append)
    first_hashes = hash_prompt_blocks(first, BS)
    cache.release(cache.acquire(first_hashes, first))
    return cache, events, first_hashes


def test_deferred_blocks_are_published_when_told_and_evictions_at_once() -> None:
    cache, events, first_hashes = _served(list(range(8)))
    events.clear()
    second = list(range(100, 108))
    second_hashes = hash_prompt_blocks(second, BS)
    lease = cache.acquire(second_hashes, second, defer_stored=True)
    assert events == [BlockRemoved((first_hashes[1],))]  # room made now, as vLLM does
    assert cache.match(second_hashes) == 2  # held and hit by the cache meanwhile
    cache.publish(lease)
    assert events[1:] == [BlockStored(tuple(second_hashes), None, tuple(second), BS)]


def test_a_deferred_lease_is_published_a_range_at_a_time() -> None:
    """Chunked prefill: each chunk's blocks go out as one event whose parent is the block
    before; the pieces add up to what one `publish` of the whole lease sends."""
    events: list[CacheEvent] = []
    cache = PrefixCache(capacity_blocks=8, block_size=BS, on_event=events.append)
    prompt = list(range(20))  # 5 blocks
    hashes = hash_prompt_blocks(prompt, BS)
    lease = cache.acquire(hashes, prompt, defer_stored=True)
    cursor = PublishCursor(cache, lease)
    cursor.through(2)
    cursor.through(2)  # nothing new
    cursor.through(4)
    cursor.through(99)  # past the lease: its last block
    assert events == [
        BlockStored(tuple(hashes[:2]), None, tuple(prompt[:8]), BS),
        BlockStored(tuple(hashes[2:4]), hashes[1], tuple(prompt[8:16]), BS, first_block=2),
        BlockStored((hashes[4],), hashes[3], tuple(prompt[16:]), BS, first_block=4),
    ]
    whole: list[CacheEvent] = []
    again = PrefixCache(capacity_blocks=8, block_size=BS, on_event=whole.append)
    again.publish(again.acquire(hashes, prompt, defer_stored=True))
    assert whole == [BlockStored(tuple(hashes), None, tuple(prompt), BS)]


def test_a_range_publishes_only_the_blocks_the_lease_cached() -> None:
    """Blocks the cache already held send nothing; a range across held and new blocks
    sends the new ones, parented on the held block before them."""
    cached = list(range(8))
    cache, events, _ = _served(cached, capacity=8)  # 2 blocks
    events.clear()
    prompt = [*cached, *range(100, 108)]  # the 2 cached blocks, then 2 new
    hashes = hash_prompt_blocks(prompt, BS)
    lease = cache.acquire(hashes, prompt, defer_stored=True)
    cache.publish(lease, 0, 1)
    assert events == []
    cache.publish(lease, 1, 3)
    cache.publish(lease, 3)
    assert events == [
        BlockStored((hashes[2],), hashes[1], tuple(prompt[8:12]), BS, first_block=2),
        BlockStored((hashes[3],), hashes[2], tuple(prompt[12:]), BS, first_block=3),
    ]


def test_lru_eviction_tail_first_and_held_blocks_stay() -> None:
    cache, events, first_hashes = _served(list(range(12)))
    second = list(range(100, 108))
    second_hashes = hash_prompt_blocks(second, BS)
    events.clear()
    held = cache.acquire(second_hashes, second)
    # The first prompt's tail goes first, then the block before it.
    assert events[:2] == [BlockRemoved((first_hashes[2],)), BlockRemoved((first_hashes[1],))]
    assert cache.match(first_hashes) == 1
    # Nothing evictable is left but first_hashes[0]; a third prompt gets only one block.
    third = list(range(200, 212))
    lease = cache.acquire(hash_prompt_blocks(third, BS), third)
    assert len(lease.block_hashes) == 1
    assert cache.usage() == 1.0
    cache.release(lease)
    cache.release(held)


def test_private_blocks_take_capacity_and_clear() -> None:
    events: list[CacheEvent] = []
    cache = PrefixCache(capacity_blocks=4, block_size=BS, on_event=events.append)
    tokens = list(range(8))
    cache.release(cache.acquire(hash_prompt_blocks(tokens, BS), tokens))
    cache.reserve_private(3)
    assert cache.num_cached == 1  # one cached block evicted for room
    assert cache.num_in_use == 3
    cache.release_private(3)
    cache.clear()
    assert cache.num_cached == 0 and isinstance(events[-1], AllBlocksCleared)


def test_prompt_hashing_equals_chained_reference() -> None:
    tokens = [7 * i % 32_000 for i in range(16 * 5 + 3)]
    for salt in (None, "tenant-a"):
        parent = none_hash("sha256", "s")
        expected = []
        for index in range(5):
            extra = (salt,) if index == 0 and salt is not None else None
            block = tokens[16 * index : 16 * (index + 1)]
            parent = hash_block_tokens(sha256_pickle, parent, block, extra)
            expected.append(event_hash(parent))
        assert hash_prompt_blocks(tokens, 16, cache_salt=salt, seed="s") == expected


def test_an_unset_seed_gives_each_engine_its_own_root() -> None:
    tokens = tuple(range(8))
    one, two = BlockHashMemo(BS, seed=None), BlockHashMemo(BS, seed=None)
    assert one.hashes(tokens) == one.hashes(tokens)  # stable within one engine
    assert one.hashes(tokens)[0] != two.hashes(tokens)[0]  # not across engines, as in vLLM
    assert BlockHashMemo(BS, seed="0").hashes(tokens) == tuple(hash_prompt_blocks(tokens, BS))


def test_block_hash_memo_matches_and_stays_bounded() -> None:
    memo = BlockHashMemo(block_size=BS, max_entries=2)
    prompts = [tuple(range(n, n + 9)) for n in range(4)]
    for prompt in prompts + prompts:
        assert list(memo.hashes(prompt, "salt")) == hash_prompt_blocks(
            prompt, BS, cache_salt="salt"
        )
    assert len(memo._memo) == 2
