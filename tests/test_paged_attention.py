"""rose.attention.paged: the CSR page layout read off attention metadata, the decoder's
paged-kernel path against its SDPA path (on the CPU through the plain-PyTorch reference
kernel, the contract FlashInfer implements), and FlashInfer itself where a GPU has it (at
head_dim 64: FlashInfer takes 64/128/256; the test fails if the kernel fell back while
FlashInfer imports, and skips with the reason where it does not)."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import VOCAB, tiny_target

from rose.attention.flashinfer import flashinfer_coverage
from rose.attention.metadata import AttentionMetadata
from rose.attention.paged import (
    PagedLayout,
    ReferencePagedAttention,
    paged_kernel_for,
)
from rose.kv.allocator import PageAllocator
from rose.kv.block_table import BlockTable
from rose.models.llama import LlamaConfig, LlamaForCausalLM
from rose.spec.tree import DraftTree, tree_metadata

PAGE = 4


def _tables(lengths: list[int], alloc: PageAllocator) -> list[BlockTable]:
    """Block tables whose pages interleave: each table takes one page at a time, in turn,
    so no sequence's pages are contiguous or in id order."""
    tables = [BlockTable(alloc, PAGE) for _ in lengths]
    for want in range(1, max(lengths) + 1):
        for t, n in zip(tables, lengths, strict=True):
            if n >= want:
                t.reserve(want)
    return tables


@pytest.mark.parametrize(
    "cached,new",
    [([0], [9]), ([13], [1]), ([5, 0, 12], [1, 7, 4]), ([3, 8], [1, 1]), ([16, 4], [4, 4])],
)
def test_layout_lists_each_sequences_pages_and_last_page_fill(
    cached: list[int], new: list[int]
) -> None:
    alloc = PageAllocator(64)
    lengths = [c + n for c, n in zip(cached, new, strict=True)]
    tables = _tables(lengths, alloc)
    meta = AttentionMetadata.build(list(zip(tables, cached, new, strict=True)))
    lay = PagedLayout.from_metadata(meta)
    p = lay.pages
    assert p.page_size == PAGE
    assert p.qo_indptr.tolist() == [0, *torch.tensor(new).cumsum(0).tolist()]
    for b, (t, n) in enumerate(zip(tables, lengths, strict=True)):
        pages = p.kv_indices[p.kv_indptr[b] : p.kv_indptr[b + 1]].tolist()
        assert pages == t.pages[: -(-n // PAGE)]  # the table's own pages, in token order
        assert p.kv_last_page_len[b] == n - (len(pages) - 1) * PAGE
        assert 1 <= p.kv_last_page_len[b] <= PAGE
    assert p.lengths() == list(zip(new, lengths, strict=True))
    assert lay.custom_mask is None
    # host tensors, int32, as FlashInfer's plan() takes them
    for x in (p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len):
        assert x.dtype == torch.int32 and x.device.type == "cpu"


def _passes(model, kernel, trees: bool) -> list[torch.Tensor]:
    """Prefill three prompts of different lengths together, then a ragged verification-like
    pass (1, 3 and 5 new tokens; as a draft tree for the second sequence when ``trees``),
    then a decode step of all three; the logits of every pass."""
    model.paged_kernel = kernel
    device = model.tok_embeddings.weight.device
    alloc = PageAllocator(64)
    cache = model.new_cache(64, PAGE)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (6, 11, 3)]
    tables = [BlockTable(alloc, PAGE) for _ in prompts]
    out = []
    cached = [0, 0, 0]
    for step_new in ([len(p) for p in prompts], [1, 3, 5], [1, 1, 1]):
        for t, c, n in zip(tables, cached, step_new, strict=True):
            t.reserve(c + n)
        entries = list(zip(tables, cached, step_new, strict=True))
        meta = AttentionMetadata.build(entries, device=device)
        if trees and step_new == [1, 3, 5]:
            # sequence 1: its pending token, then two draft nodes side by side
            meta = tree_metadata(meta, [(1, cached[1], 1, DraftTree([5], [[7]]))])
            assert not meta.causal
        if step_new[0] == 6:
            ids = torch.cat(prompts)
        else:
            ids = torch.randint(0, VOCAB, (sum(step_new),), generator=g)
        out.append(model(ids.to(device), meta, cache).logits)
        cached = [c + n for c, n in zip(cached, step_new, strict=True)]
    return out


@pytest.mark.parametrize("trees", [False, True])
def test_decoder_paged_kernel_path_equals_sdpa_path(trees: bool) -> None:
    model = tiny_target().requires_grad_(False)
    with torch.no_grad():
        want = _passes(model, None, trees)
        got = _passes(model, ReferencePagedAttention(), trees)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_tree_layout_carries_each_sequences_mask() -> None:
    alloc = PageAllocator(16)
    tables = _tables([7, 5], alloc)
    meta = AttentionMetadata.build([(tables[0], 6, 1), (tables[1], 1, 4)])
    tree = DraftTree([5, 6], [[7], []])  # nodes: chain 5, 6 and 7 beside 5
    meta = tree_metadata(meta, [(1, 1, 1, tree)])
    lay = PagedLayout.from_metadata(meta)
    assert lay.custom_mask is not None and lay.custom_mask.numel() == 1 * 7 + 4 * 5
    second = lay.custom_mask[7:].view(4, 5)
    # key 0 cached, key 1 the pending token, keys 2-4 the nodes 5, 6 (child of 5) and 7
    assert second.tolist() == [
        [True, True, False, False, False],
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, False, False, True],
    ]


def test_paged_kernel_choice() -> None:
    assert paged_kernel_for(torch.device("cpu"), torch.float32, 4, 2, 16) == (None, "")
    kernel, why = paged_kernel_for(torch.device("cuda"), torch.float32, 4, 2, 16)
    assert kernel is None and "fp16/bf16" in why


def _tiny_target_head_dim_64() -> LlamaForCausalLM:
    """`tiny_target`'s shape with head_dim 64, the smallest FlashInfer's kernels take."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("trees", [False, True])
def test_flashinfer_paged_kernel_matches_sdpa_on_cuda(trees: bool) -> None:
    model = _tiny_target_head_dim_64().requires_grad_(False).to("cuda", torch.bfloat16)
    kernel, why = paged_kernel_for(torch.device("cuda"), torch.bfloat16, 2, 1, 64)
    if skip := flashinfer_coverage(getattr(kernel, "name", f"sdpa ({why})")):
        pytest.skip(skip)
    with torch.no_grad():
        want = _passes(model, None, trees)
        got = _passes(model, kernel, trees)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=3e-2, rtol=3e-2)
        assert (g.argmax(-1) == w.argmax(-1)).float().mean() >= 0.95
