"""Prompt hashing (approximate and engine-exact) and both prefix indexes."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sim.block_hash import hash_prompt_blocks
from engine_sim.prefix_cache import PrefixCache
from router.kvhash.keyspace import KeySpace
from router.scheduling.approx_index import MIN_BLOCKS_PER_POD, ApproximatePrefixIndex
from router.scheduling.block_hash import (
    ApproximateHasher,
    PreciseHasher,
    approximate_block_hashes,
    render_prompt,
    render_prompt_bytes,
)
from router.scheduling.block_index import PodSlots, leading_depths, leading_depths_with_shared
from router.scheduling.precise_index import PrecisePrefixIndex
from router.tokenization import TokenizerRegistry
from tests.sim_tokens import chat_ids, prompt_ids, sim_registry, sim_server

#: vLLM's own hashes of engines started with PYTHONHASHSEED=0 (the simulator's in tests).
VLLM_SEED_0 = KeySpace.of("hashes", python_hash_seed="0")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(*contents: str, salt: str | None = None) -> dict[str, Any]:
    messages = [{"role": "system" if i == 0 else "user", "content": c}
                for i, c in enumerate(contents)]
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if salt is not None:
        body["cache_salt"] = salt
    return body


# -- approximate hashing -----------------------------------------------------------------------


def test_approximate_hashes_are_chained_prefix_hashes() -> None:
    data = bytes(range(256)) * 8  # 2048 bytes = 8 blocks of 256
    hashes = approximate_block_hashes(data, "m", None, 256)
    assert len(hashes) == 8
    # Same prefix, different tail: leading hashes agree, then diverge for good.
    other = data[:1000] + b"x" + data[1001:]
    other_hashes = approximate_block_hashes(other, "m", None, 256)
    assert other_hashes[:3] == hashes[:3]
    assert all(a != b for a, b in zip(other_hashes[3:], hashes[3:], strict=True))
    # Only full blocks count.
    assert approximate_block_hashes(data[:255], "m", None, 256) == []
    assert approximate_block_hashes(data + b"tail", "m", None, 256) == hashes


def test_model_and_salt_are_mixed_into_the_first_block() -> None:
    data = b"a" * 1024
    base = approximate_block_hashes(data, "m", None, 256)
    assert approximate_block_hashes(data, "other-model", None, 256)[0] != base[0]
    assert approximate_block_hashes(data, "m", "tenant-a", 256)[0] != base[0]
    assert approximate_block_hashes(data, "m", "tenant-a", 256) == approximate_block_hashes(
        data, "m", "tenant-a", 256
    )


def test_max_blocks_bounds_the_work() -> None:
    assert len(approximate_block_hashes(b"z" * 100_000, "m", None, 256, max_blocks=10)) == 10


@settings(max_examples=60, deadline=None)
@given(
    systems=st.lists(st.text(min_size=0, max_size=3000), min_size=1, max_size=3),
    question=st.text(max_size=1200),
    block_bytes=st.sampled_from([16, 64, 256]),
    max_blocks=st.sampled_from([3, 40, 4096]),
    salt=st.sampled_from([None, "tenant"]),
)
def test_approximate_memo_gives_the_reference_hashes(
    systems: list[str], question: str, block_bytes: int, max_blocks: int, salt: str | None
) -> None:
    """The leading-messages memo is exact: cold, warm, and with a new last message."""
    hasher = ApproximateHasher(entries=4, max_hashes=500)
    for system in systems:
        for q in (question, question + "?", question):
            body = {"messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": q}]}  # fmt: skip
            rendered = render_prompt(CHAT, body)
            assert rendered is not None
            data, lead = rendered
            assert data == render_prompt_bytes(CHAT, body)
            assert data[:lead] == render_prompt_bytes(CHAT, {"messages": body["messages"][:1]})
            expected = approximate_block_hashes(data, "m", salt, block_bytes, max_blocks)
            assert hasher.hashes(data, lead, "m", salt, block_bytes, max_blocks) == expected
    assert len(hasher) <= 4


def test_approximate_memo_is_bounded_and_keyed_by_model_and_block_size() -> None:
    hasher = ApproximateHasher(entries=3, max_hashes=10_000)
    for i in range(10):
        body = {"messages": [{"role": "system", "content": f"{i} " + "x" * 4000},
                             {"role": "user", "content": "q"}]}  # fmt: skip
        rendered = render_prompt(CHAT, body)
        assert rendered is not None
        for model, size in (("m", 256), ("other", 256), ("m", 512)):
            got = hasher.hashes(*rendered, model, None, size)
            assert got == approximate_block_hashes(rendered[0], model, None, size)
    assert len(hasher) == 3


def test_chat_rendering_is_deterministic_and_distinguishes_content() -> None:
    body = chat("You are helpful.", "Hi")
    assert render_prompt_bytes(CHAT, body) == render_prompt_bytes(CHAT, chat("You are helpful.",
                                                                             "Hi"))
    assert render_prompt_bytes(CHAT, body) != render_prompt_bytes(CHAT, chat("You are helpful",
                                                                             "Hi"))
    parts = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "http://a/1.png"}},
    ]}]}
    other = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "http://a/2.png"}},
    ]}]}
    assert render_prompt_bytes(CHAT, parts) != render_prompt_bytes(CHAT, other)
    with_tools = dict(body, tools=[{"type": "function", "function": {"name": "f"}}])
    assert render_prompt_bytes(CHAT, with_tools) != render_prompt_bytes(CHAT, body)
    assert render_prompt_bytes(COMPLETIONS, {"prompt": "abc"}) == b"abc"
    assert render_prompt_bytes(COMPLETIONS, {"prompt": ["abc", "def"]}) == b"abc"
    assert render_prompt_bytes(COMPLETIONS, {"prompt": [1, 2]}) is not None
    assert render_prompt_bytes(COMPLETIONS, {}) is None


# -- precise hashing: the ModelServer's tokenizer, then the engine's block hashes --------------

_text = st.text(alphabet=st.sampled_from(list("ab c.\n\t<|>_-é1")), max_size=80)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _text}
)
SERVER = sim_server()


def hasher_for(registry: TokenizerRegistry | None = None, **kwargs: Any) -> PreciseHasher:
    return PreciseHasher(tokenizers=registry or sim_registry(), **kwargs)


@settings(max_examples=100, deadline=None)
@given(st.lists(_message, min_size=1, max_size=6), st.sampled_from([None, "salt"]))
def test_precise_hashes_equal_the_engines(messages: list[dict[str, str]],
                                          salt: str | None) -> None:
    hasher = hasher_for(space=VLLM_SEED_0.of_size(4))  # small blocks: more to compare
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if salt:
        body["cache_salt"] = salt
    tokens = hasher.tokens(CHAT, body, SERVER)
    assert tokens is not None
    reference = chat_ids(messages)
    assert list(tokens.ids) == reference
    expected = hash_prompt_blocks(reference, 4, cache_salt=salt)
    # Twice: the second answer comes from the memo and must be identical.
    for _ in range(2):
        assert hasher.block_hashes(tokens.ids, salt, tokens.message_ends) == expected


def test_precise_memo_reuses_a_shared_prefix_exactly() -> None:
    hasher = hasher_for(space=VLLM_SEED_0)
    system = "You are a careful assistant. " * 40
    for question in ("What is the capital of France?", "And of Italy?", "Why?"):
        body = chat(system, question)
        tokens = hasher.tokens(CHAT, body, SERVER)
        assert tokens is not None
        got = hasher.block_hashes(tokens.ids, None, tokens.message_ends)
        assert got == hash_prompt_blocks(chat_ids(body["messages"]))
    assert 0 < hasher.memo_size


def test_precise_hasher_completions_and_injected_tokenizer() -> None:
    hasher = hasher_for(space=VLLM_SEED_0)
    tokens = hasher.tokens(COMPLETIONS, {"prompt": "hello world " * 20}, SERVER)
    assert tokens is not None and list(tokens.ids) == prompt_ids("hello world " * 20)
    batch = hasher.tokens(COMPLETIONS, {"prompt": ["first prompt", "second"]}, SERVER)
    assert batch is not None and list(batch.ids) == prompt_ids("first prompt")
    ids = list(range(40))
    by_ids = hasher.tokens(COMPLETIONS, {"prompt": ids}, SERVER)
    assert by_ids is not None and list(by_ids.ids) == ids
    assert hasher.block_hashes(ids, None) == hash_prompt_blocks(ids)
    assert hasher.tokens(CHAT, {"messages": "nope"}, SERVER) is None
    # No tokenizer for the server (or no server): no tokens, never a guess.
    assert hasher.tokens(CHAT, chat("x"), sim_server(tokenizer=None, name="other")) is None
    assert hasher.tokens(CHAT, chat("x")) is None
    injected = PreciseHasher(tokenize=lambda path, body: [7] * 33)
    got = injected.tokens(CHAT, chat("x"))
    assert got is not None and list(got.ids) == [7] * 33


def test_precise_memo_is_bounded() -> None:
    hasher = PreciseHasher(VLLM_SEED_0, memo_entries=5, memo_hashes=10_000)
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(30_000) for _ in range(200)]
        assert hasher.block_hashes(ids, None) == hash_prompt_blocks(ids)
    assert hasher.memo_size <= 5


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_leading_hashes_stop_at_the_first_block_nobody_holds(salt: str | None) -> None:
    """Hashed lazily, a long prompt is encoded only up to the first block no pod or pool
    holds: the keys found are the full hash's leading ones, the rest is never encoded, and
    its tokens are estimated within a few percent."""
    hasher = hasher_for(space=VLLM_SEED_0)
    rng = random.Random(4)
    words = ("alpha", "beta", "gamma", "delta", "naïve", "東京", "x1", "42", "it's")
    body = chat(" ".join(rng.choice(words) for _ in range(4000)), "and the question?",
                salt=salt)
    tokens = hasher.tokens(CHAT, body, SERVER)
    assert tokens is not None
    full = hasher.block_hashes(tokens.ids, salt)
    assert full == hash_prompt_blocks(list(tokens.ids), cache_salt=salt)
    third = len(full) // 3
    held = set(full[:third])  # some pod holds the first third
    stream = hasher.id_stream(CHAT, body, SERVER)
    assert stream is not None
    found = hasher.leading_hashes(stream, salt, VLLM_SEED_0, held.__contains__)
    assert found.keys == full[:third] and not found.complete
    assert stream.chars_read < stream.chars / 2  # the rest was never encoded
    assert abs(found.tokens - len(tokens.ids)) <= 0.05 * len(tokens.ids)
    # Everything held: every key, and the exact count.
    everything = hasher.leading_hashes(
        hasher.id_stream(CHAT, body, SERVER), salt, VLLM_SEED_0, set(full).__contains__  # type: ignore[arg-type]
    )
    assert everything.keys == full and everything.complete
    assert everything.tokens == len(tokens.ids)
    # Nothing held: no key, and a token count from the first piece alone.
    nothing = hasher.leading_hashes(
        hasher.id_stream(CHAT, body, SERVER), salt, VLLM_SEED_0, lambda key: False  # type: ignore[arg-type]
    )
    assert nothing.keys == [] and abs(nothing.tokens - len(tokens.ids)) < 0.1 * len(tokens.ids)


def test_leading_hashes_of_completions_and_untokenizable_bodies() -> None:
    hasher = hasher_for(space=VLLM_SEED_0)
    ids = list(range(100, 140))
    stream = hasher.id_stream(COMPLETIONS, {"prompt": ids}, SERVER)
    assert stream is not None
    found = hasher.leading_hashes(stream, None, VLLM_SEED_0, lambda key: True)
    assert found.keys == hash_prompt_blocks(ids) and found.tokens == 40 and found.complete
    assert hasher.id_stream(CHAT, {"messages": "nope"}, SERVER) is None
    assert hasher.id_stream(CHAT, chat("x"), sim_server(tokenizer=None, name="o")) is None


# -- the bitmask core --------------------------------------------------------------------------


def test_pod_slots_are_reused() -> None:
    slots = PodSlots()
    assert [slots.acquire(k) for k in "abc"] == [0, 1, 2]
    slots.release("b")
    assert slots.acquire("d") == 1
    assert slots.mask_of(["a", "x", "d"]) == (0b011, [0, -1, 1])


def test_leading_depths_walks_until_no_candidate_matches() -> None:
    masks = {1: 0b111, 2: 0b011, 3: 0b001, 5: 0b100}
    assert leading_depths(masks, [1, 2, 3, 4], 0b111) == {0: 3, 1: 2, 2: 1}
    assert leading_depths(masks, [1, 2, 3, 4], 0b110) == {1: 2, 2: 1}
    assert leading_depths(masks, [9, 1], 0b111) == {}
    assert leading_depths(masks, [1, 5], 0b111) == {0: 1, 1: 1, 2: 2}
    local, reach = leading_depths_with_shared(masks, {2: None, 3: None}, [1, 2, 3, 4], 0b111)
    assert local == {0: 3, 1: 2, 2: 1}
    assert reach == {0: 3, 1: 3, 2: 3}


# -- approximate index -------------------------------------------------------------------------


def test_approximate_index_match_record_and_removal() -> None:
    index = ApproximatePrefixIndex(block_bytes=256)
    index.record("ns/a", [1, 2, 3, 4])
    index.record("ns/b", [1, 2, 9])
    assert index.match(["ns/a", "ns/b", "ns/c"], [1, 2, 3, 4, 5]) == [4, 2, 0]
    assert index.match(["ns/b", "ns/a"], [1, 2, 9]) == [3, 2]
    index.remove_pod("ns/a")
    assert index.match(["ns/a", "ns/b"], [1, 2, 3]) == [0, 2]
    assert index.total_blocks == 3
    index.retain({"ns/c"})
    assert index.total_blocks == 0
    assert index.match(["ns/b"], [1]) == [0]
    assert index.memory_bytes() > 0


def test_approximate_index_lru_is_bounded_and_forgets_tails_first() -> None:
    # capacity in blocks = tokens x chars_per_token / block_bytes = 64 x 4 x 16 / 256 = 16...
    index = ApproximatePrefixIndex(block_bytes=4, chars_per_token=1.0,
                                   default_capacity_tokens=MIN_BLOCKS_PER_POD * 4)
    assert index.capacity_of("p") == MIN_BLOCKS_PER_POD
    old = list(range(1000, 1000 + 40))
    new = list(range(2000, 2000 + 40))
    index.record("p", old)
    index.record("p", new)  # 80 blocks into 64: 16 of the old prompt go, its tail first
    assert index.blocks_of("p") == MIN_BLOCKS_PER_POD
    assert index.match(["p"], old) == [24]
    assert index.match(["p"], new) == [40]
    # Touching a prompt makes it recent again.
    index.record("p", old[:24])
    index.record("p", list(range(3000, 3020)))
    assert index.match(["p"], old) == [24]
    assert index.evictions > 0


# Prompts made of runs of blocks shared between prompts (in any order, so a pod may hold a
# prompt's middle but not its head) and of new blocks; the runs hold more blocks than a
# pod's bound, so records insert, touch and evict in every order.
_RUNS = [list(range(100 * i, 100 * i + 12)) for i in range(MIN_BLOCKS_PER_POD // 8)]
_PROMPT = st.lists(
    st.one_of(st.sampled_from(_RUNS), st.lists(st.integers(10_000, 1 << 40), max_size=3)),
    min_size=1, max_size=6,
).map(lambda parts: [block for part in parts for block in part]).filter(bool)
_PROMPTS = st.lists(st.tuples(st.sampled_from(["a", "b"]), _PROMPT), min_size=1, max_size=30)


@given(records=_PROMPTS)
@settings(max_examples=60, deadline=None)
def test_approximate_index_records_as_an_lru_of_each_pod_would(
    records: list[tuple[str, list[int]]],
) -> None:
    """A record touches the prompt's blocks tail first and evicts the least recent beyond
    the bound: the index answers as one plain LRU per pod does, after every record."""
    index = ApproximatePrefixIndex(block_bytes=4, chars_per_token=1.0,
                                   default_capacity_tokens=MIN_BLOCKS_PER_POD * 4)
    reference: dict[str, OrderedDict[int, None]] = {"a": OrderedDict(), "b": OrderedDict()}
    for pod, prompt in records:
        lru = reference[pod]
        for block in reversed(prompt):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
        while len(lru) > MIN_BLOCKS_PER_POD:
            lru.popitem(last=False)
        index.record(pod, prompt)
        for probe_pod, held in reference.items():
            assert index.blocks_of(probe_pod) == len(held)
        for _, probe in records:
            expected = []
            for held in reference.values():
                depth = 0
                while depth < len(probe) and probe[depth] in held:
                    depth += 1
                expected.append(depth)
            assert index.match(["a", "b"], probe) == expected


def test_approximate_index_bound_follows_the_engines_capacity() -> None:
    index = ApproximatePrefixIndex(block_bytes=256, chars_per_token=4.0,
                                   default_capacity_tokens=64 * 64)
    assert index.capacity_of("p") == 64
    index.record("p", list(range(64)))
    index.set_capacity_tokens("p", 200 * 64)  # e.g. num_gpu_blocks x block_size
    assert index.capacity_of("p") == 200
    index.set_capacity_tokens("p", 100 * 64)
    assert index.capacity_of("p") == 100
    index.set_capacity_tokens("p", None)  # unknown again: back to the default
    assert index.capacity_of("p") == 64
    assert index.blocks_of("p") == 64


def test_approximate_lookup_cost_does_not_depend_on_pod_count() -> None:
    index = ApproximatePrefixIndex()
    prompt = list(range(50))
    for i in range(512):
        index.record(f"ns/p{i}", prompt[: i % 50])
    keys = [f"ns/p{i}" for i in range(512)]
    depths = index.match(keys, prompt)
    assert depths == [i % 50 for i in range(512)]


# -- precise index -----------------------------------------------------------------------------


def test_precise_index_media_removal_and_clear() -> None:
    index = PrecisePrefixIndex()
    index.stored("ns/a", "ns/srv", [1, 2, 3], "GPU")
    index.stored("ns/a", "ns/srv", [1, 2], "CPU")  # offloaded copy
    assert index.match(["ns/a"], "ns/srv", [1, 2, 3]) == ([3], [3])
    index.removed("ns/a", "ns/srv", [1, 2, 3], "GPU")  # evicted from GPU, still on CPU
    assert index.match(["ns/a"], "ns/srv", [1, 2, 3]) == ([2], [2])
    index.removed("ns/a", "ns/srv", [1], "CPU")
    assert index.match(["ns/a"], "ns/srv", [1, 2]) == ([0], [0])
    index.stored("ns/a", "ns/srv", [1], None)  # no medium: local
    index.cleared("ns/a")
    assert index.match(["ns/a"], "ns/srv", [1]) == ([0], [0])


def test_store_medium_blocks_count_on_every_pod_of_the_server() -> None:
    """By default the store medium is vLLM MooncakeStoreConnector's "cpu", matched as
    spelt: vLLM's CPU OffloadingConnector publishes "CPU", a tier of the pod's own."""
    index = PrecisePrefixIndex()
    index.stored("ns/a", "ns/srv", [1, 2, 3, 4], "cpu")
    index.stored("ns/b", "ns/srv", [1, 2], "GPU")
    local, reach = index.match(["ns/a", "ns/b", "ns/c"], "ns/srv", [1, 2, 3, 4, 5])
    assert local == [0, 2, 0]
    assert reach == [4, 4, 4]
    # Another server's pods do not see this store pool.
    assert index.match(["ns/x"], "ns/other", [1, 2]) == ([0], [0])
    index.removed("ns/b", "ns/srv", [3], "cpu")  # any pod may report it leaving
    assert index.match(["ns/c"], "ns/srv", [1, 2, 3]) == ([0], [2])
    index.stored("ns/c", "ns/srv", [1, 2, 3], "CPU")  # offloaded: c's own, not the pool's
    assert index.match(["ns/a", "ns/c"], "ns/srv", [1, 2, 3]) == ([0, 3], [2, 3])
    # A configured medium is matched as spelt too.
    named = PrecisePrefixIndex(store_media=["MOONCAKE"])
    named.stored("ns/a", "ns/srv", [1], "MOONCAKE")
    named.stored("ns/a", "ns/srv", [7], "mooncake")
    assert named.match(["ns/b"], "ns/srv", [1]) == ([0], [1])
    assert named.match(["ns/b"], "ns/srv", [7]) == ([0], [0])


def test_precise_index_is_bounded() -> None:
    index = PrecisePrefixIndex(max_blocks_per_pod=10, max_store_blocks=5)
    index.stored("p", "s", list(range(25)), "GPU")
    assert len(index.blocks_of("p")) == 10
    index.stored("p", "s", list(range(100, 120)), "cpu")
    assert len(index.store_blocks("s")) == 5
    assert index.overflow_evictions == 30


def test_a_full_pod_sheds_a_sixteenth_of_its_bound_at_once_oldest_first() -> None:
    index = PrecisePrefixIndex(max_blocks_per_pod=64)
    index.stored("p", "s", list(range(64)), "GPU")
    assert index.overflow_evictions == 0
    index.stored("p", "s", [100], "GPU")  # one past the bound: down to 64 - 64 // 16
    assert index.blocks_of("p") == set(range(5, 64)) | {100}
    assert index.overflow_evictions == 5
    assert index.match(["p"], "s", [0, 1, 2])[0] == [0]  # the shed blocks match nothing
    assert index.match(["p"], "s", list(range(5, 64)))[0] == [59]
    index.removed("p", "s", [5, 6], "GPU")
    index.stored("p", "s", list(range(200, 206)), "GPU")  # back at 64: nothing shed
    assert index.overflow_evictions == 5 and len(index.blocks_of("p")) == 64


def test_precise_index_mirrors_the_simulator_cache_with_evictions() -> None:
    index = PrecisePrefixIndex()
    events: list[Any] = []
    cache = PrefixCache(capacity_blocks=32, block_size=16, on_event=events.append)
    rng = random.Random(3)
    from engine_sim.cache_events import AllBlocksCleared, BlockRemoved, BlockStored

    prefixes = [[rng.randrange(30_000) for _ in range(16 * 6)] for _ in range(4)]
    for _ in range(60):
        tokens = prefixes[rng.randrange(4)] + [rng.randrange(30_000) for _ in range(40)]
        hashes = hash_prompt_blocks(tokens)
        lease = cache.acquire(hashes, tokens)
        cache.release(lease)
    for event in events:
        if isinstance(event, BlockStored):
            index.stored("p", "s", event.block_hashes, "GPU")
        elif isinstance(event, BlockRemoved):
            index.removed("p", "s", event.block_hashes, "GPU")
        elif isinstance(event, AllBlocksCleared):
            index.cleared("p")
    resident = {h for h in index.blocks_of("p")}
    assert resident == set(cache._blocks)
    for prefix in prefixes:
        hashes = hash_prompt_blocks(prefix)
        assert index.match(["p"], "s", hashes)[0] == [cache.match(hashes)]
