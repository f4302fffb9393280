"""rose.models.llama against transformers on small random Llama / Granite / Mistral / Mixtral /
Phi-3 / Qwen2 / Qwen3-MoE configs (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from rose.attention.metadata import AttentionMetadata
from rose.kv import BlockTable, PageAllocator
from rose.models.llama import (
    LlamaConfig,
    LlamaForCausalLM,
    RopeTable,
    rope_cos_sin,
    rope_inv_freq,
)

TOL = 1e-4  # max abs logit difference, fp32 CPU
PAGE = 4
PAGES = 256


def _tiny_kwargs(**over: object) -> dict[str, object]:
    kw: dict[str, object] = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,  # large enough that logits are not all ~0
    )
    kw.update(over)
    return kw


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


_PHI3: dict[str, object] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CONFIGS = {
    "llama-gqa": lambda: transformers.LlamaConfig(**_tiny_kwargs()),
    "llama-tied-mha-bias": lambda: transformers.LlamaConfig(
        **_tiny_kwargs(tie_word_embeddings=True, num_key_value_heads=4, attention_bias=True)
    ),
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(
        **_tiny_kwargs(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            head_dim=32,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ),
    "qwen2-bias": lambda: transformers.Qwen2Config(**_tiny_kwargs(num_key_value_heads=1)),
    # head_dim 24 != hidden_size / heads (16), no sliding window (Mistral v0.2 on)
    "mistral": lambda: transformers.MistralConfig(**_tiny_kwargs(head_dim=24, sliding_window=None)),
    # Mistral 7B v0.1's window: served with that context (40 tokens here fit it)
    "mistral-window": lambda: transformers.MistralConfig(**_tiny_kwargs(sliding_window=48)),
    # Qwen3-MoE: layers 0 and 2 route over 4 experts (2 per token), layer 1 stays dense
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **_tiny_kwargs(
            num_hidden_layers=3,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        )
    ),
    "qwen3-moe-step2-unnormalized": lambda: transformers.Qwen3MoeConfig(
        **_tiny_kwargs(
            head_dim=16,
            num_experts=3,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            decoder_sparse_step=2,
            norm_topk_prob=False,
        )
    ),
    # Mixtral: every layer routes, experts of intermediate_size, weights renormalized
    "mixtral": lambda: transformers.MixtralConfig(
        **_tiny_kwargs(num_local_experts=3, num_experts_per_tok=2, intermediate_size=40)
    ),
    # Granite 3: embedding, residual and attention multipliers, logits scaled down
    "granite": lambda: transformers.GraniteConfig(
        **_tiny_kwargs(
            embedding_multiplier=6.0,
            residual_multiplier=0.4,
            attention_multiplier=0.09,
            logits_scaling=2.5,
            tie_word_embeddings=True,
        )
    ),
    # Phi-3: fused qkv and gate/up projections in the checkpoint
    "phi3": lambda: transformers.Phi3Config(**_tiny_kwargs(**_PHI3)),
    # Phi-3-128k's LongRoPE: served within its original context (64 here), on short factors
    "phi3-longrope": lambda: transformers.Phi3Config(
        **_tiny_kwargs(
            **_PHI3,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.15 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
        )
    ),
}


def _pair(name: str, tmp_path: Path) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if isinstance(cfg, transformers.Qwen2Config):
        # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in ref.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    ours = LlamaForCausalLM.from_pretrained(_save(ref, tmp_path / name))
    return ref, ours


def _run(
    model: LlamaForCausalLM,
    seqs: list[list[int]],
    tables: list[BlockTable],
    cache,
    cached: list[int],
) -> torch.Tensor:
    entries = []
    for t, ids, c in zip(tables, seqs, cached, strict=True):
        t.reserve(c + len(ids))
        entries.append((t, c, len(ids)))
    meta = AttentionMetadata.build(entries)
    ids = torch.tensor([i for s in seqs for i in s])
    with torch.no_grad():
        out = model(ids, meta, cache).logits
    for t, ids_, c in zip(tables, seqs, cached, strict=True):
        t.length = c + len(ids_)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    ref, ours = _pair(name, tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (40,), generator=g)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    alloc = PageAllocator(PAGES)
    cache = ours.new_cache(PAGES, PAGE)
    got = _run(ours, [ids.tolist()], [BlockTable(alloc, PAGE)], cache, [0])
    assert want.abs().max() > 0.5  # the comparison is not between near-zero tensors
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_fused_projections_keep_the_logits(name: str, tmp_path: Path) -> None:
    # q/k/v and gate/up as one product each (what a draft head's inference copy runs),
    # biases included (Qwen2): still transformers' logits.
    ref, ours = _pair(name, tmp_path)
    for block in ours.layers:
        block.attention.fuse_qkv()
        block.mlp.fuse_gate_up()
    assert not hasattr(ours.layers[0].attention, "wq")
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    alloc = PageAllocator(PAGES)
    cache = ours.new_cache(PAGES, PAGE)
    got = _run(ours, [ids.tolist()], [BlockTable(alloc, PAGE)], cache, [0])
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias", "qwen3-moe"])
def test_batched_mixed_lengths_equal_single(name: str, tmp_path: Path) -> None:
    _, ours = _pair(name, tmp_path)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 13, 7, 30)]
    alloc = PageAllocator(PAGES)
    cache = ours.new_cache(PAGES, PAGE)
    batched = _run(ours, seqs, [BlockTable(alloc, PAGE) for _ in seqs], cache, [0] * len(seqs))
    singles = [
        _run(ours, [s], [BlockTable(alloc, PAGE)], ours.new_cache(PAGES, PAGE), [0]) for s in seqs
    ]
    torch.testing.assert_close(batched, torch.cat(singles), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "name",
    [
        "llama-gqa",
        "qwen2-bias",
        "llama3-rope-scaling",
        "mistral",
        "phi3-longrope",
        "qwen3-moe",
        "mixtral",
        "granite",
    ],
)
def test_decode_steps_equal_full_forward(name: str, tmp_path: Path) -> None:
    """Prefill part of each sequence, then feed the rest in chunks of 1..3 tokens with
    several sequences in flight (continuous batching); logits equal transformers' full pass."""
    ref, ours = _pair(name, tmp_path)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (20, 9, 33)]
    with torch.no_grad():
        want = [ref(torch.tensor([s])).logits[0] for s in seqs]
    alloc = PageAllocator(PAGES)
    cache = ours.new_cache(PAGES, PAGE)
    tables = [BlockTable(alloc, PAGE) for _ in seqs]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0, 0, 0]
    step = 0
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        chunks = []
        for i in live:
            n = 5 if done[i] == 0 else 1 + (step + i) % 3  # prefill, then 1..3 (verify-like)
            chunks.append(seqs[i][done[i] : done[i] + n])
        out = _run(ours, chunks, [tables[i] for i in live], cache, [done[i] for i in live])
        off = 0
        for i, c in zip(live, chunks, strict=True):
            got[i].append(out[off : off + len(c)])
            off += len(c)
            done[i] += len(c)
        step += 1
    for g_, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.cat(g_), w, atol=TOL, rtol=0)


def test_mistral_sliding_window_is_served_as_that_context(tmp_path: Path) -> None:
    """A Mistral window shorter than the context becomes the served context: up to the
    window transformers' sliding attention is full causal attention (the logits agree
    there), past it they part (so longer inputs must not be served)."""
    ref, ours = _pair("mistral-window", tmp_path)
    assert ours.config.max_position_embeddings == 48
    ids = torch.randint(0, 97, (64,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    cache = ours.new_cache(PAGES, PAGE)
    got = _run(ours, [ids.tolist()], [BlockTable(PageAllocator(PAGES), PAGE)], cache, [0])
    torch.testing.assert_close(got[:48], want[:48], atol=TOL, rtol=0)
    assert (got[48:] - want[48:]).abs().max() > 10 * TOL
    for window, context in ((None, 256), (256, 256), (4096, 256), (100, 100)):
        d = transformers.MistralConfig(**_tiny_kwargs(sliding_window=window)).to_dict()
        assert LlamaConfig.from_dict(d).max_position_embeddings == context, window
    # another family's sliding_window key is not Mistral's
    d = transformers.LlamaConfig(**_tiny_kwargs()).to_dict()
    assert LlamaConfig.from_dict({**d, "sliding_window": 8}).max_position_embeddings == 256


def test_phi3_longrope_is_served_within_its_original_context(tmp_path: Path) -> None:
    """Past ``original_max_position_embeddings`` transformers moves the whole sequence to
    the long factors (every cached key would change): the served context stops there,
    where the short factors and the attention factor give transformers' logits."""
    ref, ours = _pair("phi3-longrope", tmp_path)
    scaling = ours.config.rope_scaling
    assert ours.config.max_position_embeddings == 64
    assert scaling.kind == "longrope" and scaling.attention_factor > 1.0  # sqrt(1 + ln 4 / ln 64)
    ids = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(8))
    cache = ours.new_cache(PAGES, PAGE)
    got = _run(ours, [ids[:64].tolist()], [BlockTable(PageAllocator(PAGES), PAGE)], cache, [0])
    with torch.no_grad():
        within = ref(ids[None, :64]).logits[0]
        past = ref(ids[None]).logits[0]  # 70 tokens: the long factors, everywhere
    torch.testing.assert_close(got, within, atol=TOL, rtol=0)
    assert (past[:64] - within).abs().max() > 10 * TOL
    d = transformers.Phi3Config(**_tiny_kwargs(**_PHI3)).to_dict()
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        LlamaConfig.from_dict({**d, "partial_rotary_factor": 0.75})  # Phi-4-mini's


def test_rope_table_looks_up_what_rope_cos_sin_computes() -> None:
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=100000.0,
    )
    inv = rope_inv_freq(cfg)
    table = RopeTable(inv, 300, torch.float32)
    pos = torch.tensor([0, 5, 299, 17, 17])
    cos, sin = table(pos)
    want_cos, want_sin = rope_cos_sin(inv, pos, torch.float32)
    assert cos.shape == want_cos.shape == (5, 1, 16)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    with pytest.raises(IndexError):
        table(torch.tensor([300]))


def test_config_errors_name_the_key() -> None:
    base = transformers.LlamaConfig(**_tiny_kwargs()).to_dict()
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LlamaConfig.from_dict({**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="model_type"):
        LlamaConfig.from_dict({**base, "model_type": "gpt2"})


def test_weight_key_set_is_asserted(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    ref, _ = _pair("llama-gqa", tmp_path)
    d = tmp_path / "llama-gqa"
    sd = load_file(str(d / "model.safetensors"))
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd["model.layers.1.extra.weight"] = torch.zeros(1)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        LlamaForCausalLM.from_pretrained(d)
