"""Qwen3 decoders generate: rose.models.llama (with Qwen3's per-head q/k RMSNorm) against
`transformers` `Qwen3ForCausalLM` on small random configs (fp32 CPU), through the paged-KV
`GenerationEngine` with and without speculation, and Tulip's one runner decision (which
Qwen3 directories generate and which stay encoders)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from test_generate_llama import PAGE, PAGES, TOL, _run, _tiny_kwargs

from rose.generate import GenerationConfig, GenerationEngine
from rose.kv import BlockTable, KVCacheConfig, PageAllocator
from rose.models.llama import LlamaConfig, LlamaForCausalLM
from rose.sampling import SamplingParams
from rose.spec import SpecConfig, truncated_drafter
from tulip.config import ConfigError, TulipConfig
from tulip.generation import is_generator

VOCAB = 97
NEW_TOKENS = 24


def _qwen3(**over: object) -> transformers.Qwen3Config:
    # head_dim 24 != hidden_size / heads (16): the explicit head_dim is what counts
    kw = _tiny_kwargs(head_dim=24, rms_norm_eps=1e-6, eos_token_id=None, pad_token_id=0)
    kw.update(over)
    return transformers.Qwen3Config(**kw)


CONFIGS = {
    "untied": lambda: _qwen3(),
    "tied": lambda: _qwen3(tie_word_embeddings=True),
    "tied-mha-bias": lambda: _qwen3(
        tie_word_embeddings=True, num_key_value_heads=4, attention_bias=True
    ),
}


Pair = tuple[transformers.Qwen3ForCausalLM, LlamaForCausalLM, Path]


def _pair(name: str, root: Path) -> Pair:
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(CONFIGS[name]()).eval()
    with torch.no_grad():  # init leaves norms at 1 and biases at 0: make them matter
        for layer in ref.model.layers:
            attn = layer.self_attn
            attn.q_norm.weight.normal_(1.0, 0.3)
            attn.k_norm.weight.normal_(1.0, 0.3)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
    path = root / name
    ref.save_pretrained(path, safe_serialization=True)
    return ref, LlamaForCausalLM.from_pretrained(path), path


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return _pair(request.param, tmp_path_factory.mktemp("qwen3"))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for n in (3, 11, 6, 17):
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        out.append(ids + ids[: n // 2 + 1])  # a repeated span: n-gram lookup has something
    return out


@pytest.fixture(scope="module")
def want(pair: Pair) -> list[list[int]]:
    """`transformers` greedy continuations of `_prompts`, one prompt at a time."""
    return [_hf_greedy(pair[0], p)[0] for p in _prompts()]


def _hf_greedy(ref: transformers.Qwen3ForCausalLM, ids: list[int]) -> tuple[list[int], list]:
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), [x[0] for x in out.logits]


def test_config_reads_qwen3() -> None:
    raw = _qwen3(tie_word_embeddings=True).to_dict()
    cfg = LlamaConfig.from_dict(raw)
    assert (cfg.qk_norm, cfg.head_dim, cfg.tie_word_embeddings) == (True, 24, True)
    assert (cfg.qkv_bias, cfg.o_bias) == (False, False)
    no_head_dim = {k: v for k, v in raw.items() if k != "head_dim"}
    assert LlamaConfig.from_dict(no_head_dim).head_dim == 128  # transformers' Qwen3 default
    assert not LlamaConfig.from_dict(transformers.Qwen2Config(**_tiny_kwargs()).to_dict()).qk_norm
    with pytest.raises(ValueError, match="layer_types"):
        LlamaConfig.from_dict({**raw, "layer_types": ["sliding_attention", "full_attention"]})


def test_prefill_logits_match_transformers(pair: Pair) -> None:
    ref, ours, _ = pair
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    alloc = PageAllocator(PAGES)
    got = _run(ours, [ids.tolist()], [BlockTable(alloc, PAGE)], ours.new_cache(PAGES, PAGE), [0])
    assert want.abs().max() > 0.5  # the comparison is not between near-zero tensors
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_decode_step_logits_match_transformers(pair: Pair) -> None:
    """Prefill, then one token a step (this engine's greedy choice fed back): every step's
    logits equal those `transformers` `generate` computed from its KV cache."""
    ref, ours, _ = pair
    prompt = _prompts()[1]
    want_ids, want_logits = _hf_greedy(ref, prompt)
    alloc = PageAllocator(PAGES)
    cache = ours.new_cache(PAGES, PAGE)
    table = BlockTable(alloc, PAGE)
    feed, done, got_ids = prompt, 0, []
    for want in want_logits:
        logits = _run(ours, [feed], [table], cache, [done])[-1]
        torch.testing.assert_close(logits, want, atol=TOL, rtol=0)
        done += len(feed)
        feed = [int(logits.argmax())]
        got_ids.append(feed[0])
    assert got_ids == want_ids


def test_fused_projections_keep_the_logits(pair: Pair) -> None:
    # q/k/v as one product (a draft head's inference copy): q and k still get their own norms
    ref, _, path = pair
    ours = LlamaForCausalLM.from_pretrained(path)
    for block in ours.layers:
        block.attention.fuse_qkv()
        block.mlp.fuse_gate_up()
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    alloc = PageAllocator(PAGES)
    got = _run(ours, [ids.tolist()], [BlockTable(alloc, PAGE)], ours.new_cache(PAGES, PAGE), [0])
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def _engine(model: LlamaForCausalLM, spec: SpecConfig | None = None, **kw: object):  # noqa: ANN202
    config = GenerationConfig(
        kv=KVCacheConfig(num_pages=PAGES, page_size=PAGE), max_batch=8, spec=spec or SpecConfig()
    )
    return GenerationEngine(model, config, **kw)  # type: ignore[arg-type]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS)


def test_greedy_generation_equals_transformers_batched_and_alone(
    pair: Pair, want: list[list[int]]
) -> None:
    ours = pair[1]
    prompts = _prompts()
    batched = _engine(ours).generate(prompts, GREEDY)
    assert [r.output_ids for r in batched] == want
    for prompt, w in zip(prompts, want, strict=True):
        [alone] = _engine(ours).generate([prompt], GREEDY)
        assert alone.output_ids == w
        assert alone.finish_reason == "length"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_greedy_equals_plain_greedy(
    pair: Pair, want: list[list[int]], method: str
) -> None:
    ours = pair[1]
    prompts = _prompts()
    spec = SpecConfig(method=method, num_draft_tokens=4)
    drafter = truncated_drafter(ours, 1) if method == "draft" else None
    engine = _engine(ours, spec, drafter=drafter)
    got = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in got] == want
    assert engine.stats.drafted > 0  # speculation really ran


# -- which Qwen3 directories generate ---------------------------------------------------------


def _dir(root: Path, name: str, architectures: list[str], modules: list[str] = ()) -> Path:
    """A model directory with only what the decision reads: config.json and, when
    ``modules`` names sentence-transformers module classes, modules.json."""
    path = root / name
    path.mkdir()
    raw = _qwen3().to_dict()
    raw["architectures"] = architectures
    (path / "config.json").write_text(json.dumps(raw))
    if modules:
        listed = [
            {"idx": i, "name": str(i), "path": "" if i == 0 else f"{i}_{kind}", "type": kind}
            for i, kind in enumerate(f"sentence_transformers.models.{m}" for m in modules)
        ]
        (path / "modules.json").write_text(json.dumps(listed))
    return path


def test_runner_decision(tmp_path: Path) -> None:
    causal = _dir(tmp_path, "bare", ["Qwen3ForCausalLM"])
    embedder = _dir(tmp_path, "embedder", ["Qwen3ForCausalLM"], ["Transformer", "Pooling"])
    reranker = _dir(tmp_path, "reranker", ["Qwen3ForCausalLM"], ["Transformer", "LogitScore"])
    backbone = _dir(tmp_path, "backbone", ["Qwen3Model"])
    classifier = _dir(tmp_path, "classifier", ["Qwen3ForSequenceClassification"])
    assert is_generator(causal)
    for encoder in (embedder, reranker, backbone, classifier):
        assert not is_generator(encoder), encoder.name
    # the override wins either way
    assert is_generator(embedder, "generate")
    assert not is_generator(causal, "pooling")
    assert is_generator(causal, "auto")


def test_runner_flag_and_env() -> None:
    assert TulipConfig(model="m").runner == "auto"
    assert TulipConfig.from_args(["--model", "m", "--runner", "pooling"]).runner == "pooling"
    env = {"TULIP_RUNNER": "generate"}
    assert TulipConfig.from_args(["--model", "m"], env).runner == "generate"
    assert TulipConfig.from_args(["--model", "m", "--runner", "auto"], env).runner == "auto"
    with pytest.raises(ConfigError, match="--runner"):
        TulipConfig(model="m", runner="embed")
