"""Draft trees (`rose.spec.tree`): the greedy tree walk against a brute-force reference,
the tree mask against plain causal passes over each root-to-node path, and the engine with
a trained head drafting trees: output identical to plain greedy, alternatives kept."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_llama import VOCAB, random_prompts, tiny_target

from rose.attention.metadata import AttentionMetadata
from rose.generate import GenerationConfig, GenerationEngine
from rose.kv.allocator import PageAllocator
from rose.kv.block_table import BlockTable
from rose.models.llama import LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.spec import SpecConfig
from rose.spec.mtp import MTPHead
from rose.spec.train_mtp import TrainConfig, answer_prompts, target_features, train_head
from rose.spec.tree import DraftTree, DynamicTree, accept_greedy_tree, tree_metadata

GREEDY = SamplingParams(max_tokens=24)


def _random_tree(rng: random.Random, vocab: int = 6) -> DraftTree:
    k = rng.randint(1, 4)
    chain = [rng.randrange(vocab) for _ in range(k)]
    alts = []
    for d in range(rng.randint(0, k)):
        others = [t for t in range(vocab) if t != chain[d]]
        alts.append(rng.sample(others, rng.randint(0, 3)))
    return DraftTree(chain, alts)


def _reference_walk(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    """Keep a node iff its parent is kept (or is the root) and its token is the target's
    argmax after the parent; the kept path is the deepest kept node's ancestry."""
    parents, tokens = tree.parents, tree.tokens
    kept: dict[int, list[int]] = {-1: []}
    changed = True
    while changed:
        changed = False
        for j, (p, t) in enumerate(zip(parents, tokens, strict=True)):
            if j not in kept and p in kept and t == argmax[p + 1]:
                kept[j] = [*kept[p], j]
                changed = True
    deepest = max(kept.values(), key=len)
    return deepest, argmax[deepest[-1] + 1 if deepest else 0]


def test_greedy_tree_walk_matches_the_reference() -> None:
    rng = random.Random(0)
    alternatives = 0
    for _ in range(3000):
        tree = _random_tree(rng)
        argmax = [rng.randrange(6) for _ in range(1 + len(tree.tokens))]
        got = accept_greedy_tree(tree, argmax)
        assert got == _reference_walk(tree, argmax), (tree, argmax)
        alternatives += bool(got[0]) and got[0][-1] >= len(tree.chain)
    assert alternatives > 100  # the walk really ends in alternatives, not only the chain


def test_tree_shape() -> None:
    tree = DraftTree([10, 11, 12], [[20, 21], [], [22]])
    assert tree.tokens == [10, 11, 12, 20, 21, 22]
    assert tree.depths == [1, 2, 3, 1, 1, 3]
    assert tree.parents == [-1, 0, 1, -1, -1, 1]
    with pytest.raises(ValueError, match="alternatives at 2 depths"):
        DraftTree([1], [[2], [3]])


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


def _plain_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    table = BlockTable(PageAllocator(16), 16)
    table.reserve(len(ids))
    meta = AttentionMetadata.build([(table, 0, len(ids))])
    return model(torch.tensor(ids), meta, model.new_cache(16, 16)).logits[-1]


@pytest.mark.parametrize("batch", [1, 2])
@torch.no_grad()
def test_tree_pass_equals_plain_passes_over_each_path(target: LlamaForCausalLM, batch: int) -> None:
    """One verification pass over pending tokens + a tree gives, at every node, the logits
    of a plain causal pass over the prompt + that node's root-to-node path; with a second
    sequence in the batch (padded layout) fed plainly beside it."""
    prompt = random_prompts(3, 1)[0]
    cached, pending = prompt[:-2], prompt[-2:]
    tree = DraftTree([5, 6, 7], [[8, 9], [10], [11, 12]])
    alloc = PageAllocator(32)
    cache = target.new_cache(32, 16)
    table = BlockTable(alloc, 16)
    table.reserve(len(cached))
    target(torch.tensor(cached), AttentionMetadata.build([(table, 0, len(cached))]), cache)
    feed = pending + tree.tokens
    table.reserve(len(cached) + len(feed))
    entries = [(table, len(cached), len(feed))]
    other = random_prompts(4, 1)[0]
    if batch == 2:
        t2 = BlockTable(alloc, 16)
        t2.reserve(len(other))
        entries.append((t2, 0, len(other)))
    meta = tree_metadata(AttentionMetadata.build(entries), [(0, len(cached), len(pending), tree)])
    ids = feed + (other if batch == 2 else [])
    logits = target(torch.tensor(ids), meta, cache, torch.arange(len(ids))).logits
    root = len(pending) - 1
    torch.testing.assert_close(logits[root], _plain_logits(target, prompt), atol=1e-4, rtol=0)
    parents, tokens = tree.parents, tree.tokens
    for j in range(len(tokens)):
        path, p = [tokens[j]], parents[j]
        while p >= 0:
            path.insert(0, tokens[p])
            p = parents[p]
        want = _plain_logits(target, prompt + path)
        torch.testing.assert_close(logits[len(pending) + j], want, atol=1e-4, rtol=0)
    if batch == 2:
        torch.testing.assert_close(
            logits[len(feed) :][-1], _plain_logits(target, other), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("pending", [1, 2])
def test_tree_metadata_reads_nothing_back_from_the_device(pending: int) -> None:
    # On the meta device a tensor has no data: any .tolist(), .item() or host copy of one
    # raises, as a read-back would make a GPU pass wait for the queued work (#26, item 6).
    # The same build on the CPU must give the same shapes, and this tree's known mask.
    tree = DraftTree([5, 6], [[7], []])
    alloc = PageAllocator(32)
    tables = [BlockTable(alloc, 16) for _ in range(2)]
    tables[0].reserve(3 + pending + len(tree.tokens))
    tables[1].reserve(4)
    entries = [(tables[0], 3, pending + len(tree.tokens)), (tables[1], 3, 1)]
    trees = [(0, 3, pending, tree)]
    on_meta = tree_metadata(AttentionMetadata.build(entries, device="meta"), trees)
    on_cpu = tree_metadata(AttentionMetadata.build(entries), trees)
    assert on_meta.mask is not None and on_cpu.mask is not None
    assert on_meta.mask.device.type == "meta" and on_meta.positions.device.type == "meta"
    assert on_meta.mask.shape == on_cpu.mask.shape
    root = 3 + pending
    nodes = on_cpu.mask[0, 0, pending : pending + 3, root : root + 3]
    ancestry = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)  # c1 c2 a1
    assert torch.equal(nodes, ancestry)
    assert on_cpu.positions[pending : pending + 3].tolist() == [root, root + 1, root]


@pytest.fixture(scope="module")
def head(target: LlamaForCausalLM) -> MTPHead:
    seqs = answer_prompts(target, random_prompts(10, 96), answer_tokens=32)
    feats = target_features(target, seqs)
    head, _ = train_head(target, seqs, feats, TrainConfig(epochs=6, lr=3e-3, batch_tokens=512))
    return head


def _generate(target, head, prompts, widths=(), params=GREEDY):
    spec = SpecConfig(method="mtp", num_draft_tokens=3, tree_widths=widths)
    eng = GenerationEngine(target, GenerationConfig(max_batch=8, spec=spec), mtp_head=head)
    return [r.output_ids for r in eng.generate(prompts, params)], eng


def test_trees_are_lossless_and_keep_alternatives(target: LlamaForCausalLM, head: MTPHead) -> None:
    prompts = random_prompts(20, 50)
    base = [r.output_ids for r in GenerationEngine(target).generate(prompts, GREEDY)]
    chain, eng_chain = _generate(target, head, prompts)
    tree, eng_tree = _generate(target, head, prompts, widths=(4, 3, 2))
    assert chain == base
    assert tree == base
    st = eng_tree.stats
    assert st.alternatives > 0, st.as_dict()
    # the alternatives are extra accepted drafts on top of what the same chain would keep
    assert st.mean_accepted_length > eng_chain.stats.mean_accepted_length, (
        st.as_dict(),
        eng_chain.stats.as_dict(),
    )
    assert eng_tree.allocator.num_free == eng_tree.config.kv.num_pages


def test_sampled_requests_draft_plain_chains(target: LlamaForCausalLM, head: MTPHead) -> None:
    prompts = random_prompts(21, 4)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3)
    out, eng = _generate(target, head, prompts, widths=(3, 2), params=params)
    assert eng.stats.alternatives == 0 and eng.stats.drafted > 0
    assert all(len(o) == 16 and all(0 <= t < VOCAB for t in o) for o in out)


def test_tree_widths_validation() -> None:
    assert SpecConfig(method="mtp", num_draft_tokens=3, tree_widths=(3, 2)).max_fed_drafts == 6
    with pytest.raises(ValueError, match="tree_widths must be a tuple of ints >= 1"):
        SpecConfig(method="mtp", tree_widths=(2, 0))
    with pytest.raises(ValueError, match="tree_widths is for method 'mtp'"):
        SpecConfig(method="ngram", tree_widths=(2,))
    with pytest.raises(ValueError, match="3 depths but num_draft_tokens is 2"):
        SpecConfig(method="mtp", num_draft_tokens=2, tree_widths=(2, 2, 2))
    assert SpecConfig(method="mtp", num_draft_tokens=4, tree_nodes=5).max_fed_drafts == 5
    with pytest.raises(ValueError, match="tree_nodes must be >= 0"):
        SpecConfig(method="mtp", tree_nodes=-1)
    with pytest.raises(ValueError, match="tree_nodes is for method 'mtp'"):
        SpecConfig(method="draft", tree_nodes=3)
    with pytest.raises(ValueError, match="excludes spec.tree_widths"):
        SpecConfig(method="mtp", tree_nodes=3, tree_widths=(2,))


def _ranked(rng: random.Random, width: int) -> tuple[list[int], list[float]]:
    """Distinct tokens with descending probabilities summing to at most 1."""
    raw = sorted((rng.random() ** 3 for _ in range(width)), reverse=True)
    total = sum(raw) / rng.uniform(0.5, 1.0)
    return rng.sample(range(100), width), [r / total for r in raw]


def test_dynamic_tree_picks_the_likeliest_nodes() -> None:
    """The nodes kept are the `nodes` candidates with the highest path probability among
    all depths the head could have run (stopping early never loses one), and they form a
    chain plus leaves."""
    rng = random.Random(1)
    stopped_early = 0
    for _ in range(2000):
        nodes, k = rng.randint(1, 6), rng.randint(1, 4)
        levels = [_ranked(rng, nodes) for _ in range(k)]
        tree = DynamicTree(nodes)
        steps = 0
        for d, (toks, probs) in enumerate(levels):
            tree.add(toks, probs, can_grow=d + 1 < k)
            steps += 1
            if not tree.grows:
                break
        stopped_early += steps < k
        chain, alts = tree.select()
        # reference: every candidate of every depth with its path probability
        cands, reach = [], 1.0
        for d, (toks, probs) in enumerate(levels):
            cands += [
                (reach * p, d, j > 0, t) for j, (t, p) in enumerate(zip(toks, probs, strict=True))
            ]
            reach *= probs[0]
        want = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:nodes]
        got = [(d, False, t) for d, t in enumerate(chain)] + [
            (d, True, t) for d, level in enumerate(alts) for t in level
        ]
        assert sorted(got) == sorted((d, a, t) for _, d, a, t in want)
        assert chain == [levels[d][0][0] for d in range(len(chain))]
        assert len(chain) + sum(map(len, alts)) == min(nodes, len(cands))
        DraftTree(chain, alts)  # a valid tree: alternatives only where the chain reaches
    assert stopped_early > 200  # the early stop is exercised


def test_dynamic_trees_are_lossless_and_keep_alternatives(
    target: LlamaForCausalLM, head: MTPHead
) -> None:
    prompts = random_prompts(22, 50)
    base = [r.output_ids for r in GenerationEngine(target).generate(prompts, GREEDY)]
    spec = SpecConfig(method="mtp", num_draft_tokens=4, tree_nodes=5)
    eng = GenerationEngine(target, GenerationConfig(max_batch=8, spec=spec), mtp_head=head)
    assert [r.output_ids for r in eng.generate(prompts, GREEDY)] == base
    assert eng.stats.alternatives > 0 and eng.stats.accepted > 0, eng.stats.as_dict()
    assert eng.allocator.num_free == eng.config.kv.num_pages
    # one node: the head's single likeliest token, a chain of one
    spec = SpecConfig(method="mtp", num_draft_tokens=4, tree_nodes=1)
    one = GenerationEngine(target, GenerationConfig(max_batch=8, spec=spec), mtp_head=head)
    assert [r.output_ids for r in one.generate(prompts, GREEDY)] == base
    assert one.stats.drafted == one.stats.steps > 0 and one.stats.alternatives == 0


def test_default_tulip_tree_mixes_with_sampled_requests(
    target: LlamaForCausalLM, head: MTPHead
) -> None:
    """Tulip's ``--spec mtp`` default (a dynamic tree of 3 nodes, 3 deep) in batches where
    greedy requests draft trees and sampled ones chains, side by side: greedy output stays
    exactly plain greedy, and every page comes back."""
    prompts = random_prompts(23, 24)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=5)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(prompts))]
    base = [r.output_ids for r in GenerationEngine(target).generate(prompts[::2], GREEDY)]
    spec = SpecConfig(method="mtp", num_draft_tokens=3, tree_nodes=3)
    eng = GenerationEngine(target, GenerationConfig(max_batch=8, spec=spec), mtp_head=head)
    out = [r.output_ids for r in eng.generate(prompts, params)]
    assert out[::2] == base
    assert all(len(o) == 16 and all(0 <= t < VOCAB for t in o) for o in out[1::2])
    assert eng.stats.alternatives > 0 and eng.stats.accepted > 0, eng.stats.as_dict()
    assert eng.allocator.num_free == eng.config.kv.num_pages
