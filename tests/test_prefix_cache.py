"""Prefix caching (`rose.kv.prefix`): pages found again by content, shared by reference
count, never written while shared, evicted least recently used. Greedy output with the
cache equals `transformers`' greedy output; a request whose prompt starts with a cached
prefix feeds only the rest of it."""

from __future__ import annotations

import pytest
import tiny_configs
import torch

from rose.generate import GenerationConfig, GenerationEngine
from rose.kv import BlockTable, KVCacheConfig, PageAllocator, PrefixCache
from rose.kv.prefix import chain_key
from rose.models.llama import LlamaForCausalLM
from rose.runner import Chunk
from rose.sampling import SamplingParams
from rose.spec import SpecConfig
from rose.spec.mtp import MTPHead, MTPHeadConfig

VOCAB = 97  # tiny_configs.llama's
PAGE = 4
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW)


# -- pages and keys (no model) ---------------------------------------------------------


def test_shared_pages_are_counted_and_idle_ones_evicted_least_recently_released_first() -> None:
    cache = PrefixCache(PAGE)
    a = PageAllocator(4, cache)
    t1 = BlockTable(a, PAGE)
    t1.reserve(8)
    t1.length = 8
    t1.commit(list(range(8)))  # two full pages registered
    assert cache.num_pages == 2
    pages, keys = cache.lookup(list(range(10)), limit=9)
    assert pages == t1.pages and keys == t1.keys
    t2 = BlockTable(a, PAGE)
    t2.adopt(pages, keys)
    assert t2.length == 8 and a.num_free == 2
    t1.release()  # still held by t2: not idle, not free
    assert a.num_free == 2 and cache.num_idle == 0
    t2.release()  # registered: idle, counted as free, still found
    assert a.num_free == 4 and cache.num_idle == 2
    assert cache.lookup(list(range(10)), limit=9)[0] == pages
    # Free pages go first; then the idle page released first (t2's first page) is evicted.
    t3 = BlockTable(a, PAGE)
    t3.reserve(12)
    assert cache.stats.evicted_pages == 1 and pages[0] in t3.pages
    assert cache.lookup(list(range(10)), limit=9)[0] == []  # the chain starts at page 0
    t3.release()
    assert a.num_free == 4 and cache.num_idle == 1  # the evicted page came back free
    with pytest.raises(ValueError, match="neither held nor cached"):
        BlockTable(a, PAGE).adopt([pages[0]], [keys[0]])


def test_a_key_names_the_whole_prefix_not_just_the_page() -> None:
    cache = PrefixCache(PAGE)
    a = PageAllocator(8, cache)
    t = BlockTable(a, PAGE)
    t.reserve(8)
    t.length = 8
    t.commit([1, 2, 3, 4, 5, 6, 7, 8])
    # Same second page after a different first page: no hit at all.
    assert cache.lookup([9, 9, 9, 9, 5, 6, 7, 8, 0], limit=8) == ([], [])
    # A hit never goes past `limit` (the request's last token is always computed).
    assert len(cache.lookup([1, 2, 3, 4, 5, 6, 7, 8], limit=7)[0]) == 1
    assert chain_key(b"", [1, 2, 3, 4]) != chain_key(b"", [1, 2, 3, 5])


def test_commit_registers_only_committed_tokens() -> None:
    """A request that stopped inside an accepted chain wrote more K/V than it kept tokens:
    only pages full of its tokens are registered, and a truncated table forgets its keys."""
    cache = PrefixCache(PAGE)
    a = PageAllocator(8, cache)
    t = BlockTable(a, PAGE)
    t.reserve(12)
    t.length = 9
    t.commit(list(range(7)))  # 9 written, 7 kept: one full page
    assert len(t.keys) == 1 and cache.num_pages == 1
    t.commit(list(range(9)))
    assert len(t.keys) == 2
    t.truncate(5)
    assert len(t.keys) == 1


# -- the engine against transformers ---------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    return tiny_configs.llama_pair(tmp_path_factory.mktemp("tiny-llama") / "llama")


def hf_greedy(ref: torch.nn.Module, prompt: list[int], new: int = NEW) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 is a token, not padding
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def prompts_sharing(prefix_len: int, suffixes: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, VOCAB, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in suffixes]


def counting(engine: GenerationEngine) -> list[list[tuple[int, int]]]:
    """Record (cached, fed) of every chunk of every pass the engine's runner runs."""
    passes: list[list[tuple[int, int]]] = []
    forward = engine.runner.forward

    def spy(chunks: list[Chunk], *args: object) -> object:
        passes.append([(c.cached, len(c.ids)) for c in chunks])
        return forward(chunks, *args)

    engine.runner.forward = spy  # type: ignore[method-assign]
    return passes


def engine_for(model: LlamaForCausalLM, pages: int = 128, **kw: object) -> GenerationEngine:
    return GenerationEngine(model, GenerationConfig(kv=KVCacheConfig(pages, PAGE), **kw))  # type: ignore[arg-type]


def test_a_shared_prefix_is_not_prefilled_again_and_output_is_transformers_greedy(
    models: tuple[torch.nn.Module, LlamaForCausalLM],
) -> None:
    ref, model = models
    first, second = prompts_sharing(41, [3, 6])
    engine = engine_for(model)
    passes = counting(engine)
    [a] = engine.generate([first], GREEDY)
    passes.clear()
    [b] = engine.generate([second], GREEDY)
    assert a.output_ids == hf_greedy(ref, first)
    assert b.output_ids == hf_greedy(ref, second)
    # 40 of the 41 shared tokens are whole pages: the second prompt's prefill starts there.
    assert passes[0] == [(40, len(second) - 40)]
    stats = engine.prefix_cache.stats  # type: ignore[union-attr]
    assert stats.hit_tokens == 40 and stats.queried_tokens == len(first) + len(second)
    assert engine.allocator.num_free == 128  # every page free or idle again


def test_a_prompt_seen_whole_recomputes_only_its_last_page(
    models: tuple[torch.nn.Module, LlamaForCausalLM],
) -> None:
    ref, model = models
    [prompt] = prompts_sharing(32, [0])  # 8 whole pages
    engine = engine_for(model)
    passes = counting(engine)
    engine.generate([prompt], GREEDY)
    passes.clear()
    [again] = engine.generate([prompt], GREEDY)
    assert passes[0] == [(28, 4)]  # the last token must be computed: its page is not shared
    assert again.output_ids == hf_greedy(ref, prompt)


def test_pages_shared_with_a_running_request_are_never_written(
    models: tuple[torch.nn.Module, LlamaForCausalLM],
) -> None:
    """B adopts A's prefix pages while A is still decoding; both continue exactly."""
    ref, model = models
    a_prompt, b_prompt, c_prompt = prompts_sharing(24, [1, 2, 9])
    engine = engine_for(model)
    outputs: dict[int, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.seq_id, []).extend(out.new_ids)

    engine.add(a_prompt, GREEDY)
    for _ in range(3):  # A's prompt is in the cache and registered; A is decoding
        step()
    engine.add(b_prompt, GREEDY)
    engine.add(c_prompt, GREEDY)
    step()
    shared = [r for r in engine.scheduler.running if r.prompt_len == len(b_prompt)][0]
    assert shared.table.pages[:6] == engine.scheduler.running[0].table.pages[:6]
    while engine.has_unfinished():
        step()
    prompts = [a_prompt, b_prompt, c_prompt]
    assert [outputs[i] for i in range(3)] == [hf_greedy(ref, p) for p in prompts]
    assert engine.allocator.num_free == 128


def test_eviction_under_pressure_keeps_output_exact(
    models: tuple[torch.nn.Module, LlamaForCausalLM],
) -> None:
    """A pool too small to keep every prefix: idle pages are evicted LRU, nothing breaks."""
    ref, model = models
    g = torch.Generator().manual_seed(11)
    groups = [torch.randint(0, VOCAB, (20,), generator=g).tolist() for _ in range(4)]
    prompts = [groups[i // 2] + [i, i + 1] for i in range(8)]  # pairs share 20 tokens
    engine = engine_for(model, pages=24, max_batch=1)
    results = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in results] == [hf_greedy(ref, p) for p in prompts]
    stats = engine.prefix_cache.stats  # type: ignore[union-attr]
    assert stats.evicted_pages > 0 and stats.hit_tokens > 0
    assert engine.allocator.num_free == 24


def test_ngram_speculation_with_the_prefix_cache_stays_greedy(
    models: tuple[torch.nn.Module, LlamaForCausalLM],
) -> None:
    ref, model = models
    base = prompts_sharing(30, [4])[0]
    prompts = [base + base[:10], base + base[5:12]]  # repeats, so n-gram drafts something
    engine = engine_for(model, spec=SpecConfig(method="ngram", num_draft_tokens=3))
    results = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert [r.output_ids for r in results] == [hf_greedy(ref, p) for p in prompts]
    assert engine.prefix_cache.stats.hit_tokens >= 28  # type: ignore[union-attr]


def test_proposers_with_their_own_cache_run_without_prefix_cache(
    models: tuple[torch.nn.Module, LlamaForCausalLM],
) -> None:
    _, model = models
    head = MTPHead(MTPHeadConfig.for_target(model.config, draft_vocab_size=32))
    engine = GenerationEngine(
        model,
        GenerationConfig(kv=KVCacheConfig(64, PAGE), spec=SpecConfig(method="mtp")),
        mtp_head=head,
    )
    assert engine.prefix_cache is None
    assert "mtp" in (engine.prefix_cache_off_reason or "")
    off = engine_for(model, prefix_cache=False)
    assert off.prefix_cache is None and off.prefix_cache_off_reason == "turned off"
