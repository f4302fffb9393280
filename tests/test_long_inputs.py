"""Long inputs on CPU (issue #22): a 32,768-token row embeds with memory linear in its length.

A tiny random Qwen3 (2 layers, 2 query heads sharing 1 key-value head of 16 dims,
max_position_embeddings 40960; attention is what costs at 32K, so as few heads as keep GQA),
causal (Qwen3-Embedding) and bidirectional (pplx-embed), saved with ``save_pretrained`` and
served through `rose.Engine`:

* 32,768 tokens in a fresh subprocess: peak RSS growth over the pass stays under
  `PEAK_GROWTH_BOUND_MIB` (512). The peak is the kernel's high-water mark (VmHWM, what
  ``ru_maxrss`` reports), reset through ``/proc/self/clear_refs`` right before the pass, after
  a warm-up: a plain ``ru_maxrss`` difference would hide the pass under the peak of imports
  and loading (and of the forking parent), reading 0. What the pass needs is linear: a few hundred floats per
  token for the live layer (hidden, q/k/v, attention output, MLP intermediates), i.e. tens of
  MiB at 32K, plus the first layer's q/k/v/output the test keeps (12 MiB); measured ~40-50
  MiB. Anything quadratic is far above the bound: one [L, L] fp32 score matrix of one head
  is 4 GiB, a [L, L] bool mask 1 GiB, the int64 relative positions of `rose.models.rows`
  8 GiB.
  The same pass checks its attention: the first layer's output on 64 query rows (the first,
  the last, the rest random) against exact float64 attention over the whole row, max abs
  difference < 1e-5 (fp32 sums over 32K keys; measured ~3e-8).
* 4,096 tokens (over the CPU block-diagonal cap, so the masked form is never taken) against
  `transformers`' ``Qwen3Model``: mean-pooled embeddings within 1e-4 (the repo's fp32
  tolerance against transformers); the long row batched among short rows equals it alone
  within 1e-5, under "auto" and under an explicit "block-diagonal" strategy.
* A windowed family's own SDPA (`rose.models.rows`): a ModernBERT row longer than two query
  blocks against transformers within 1e-4, and batched (block-diagonal mask, one call) equal
  to alone (query-blocked) within 1e-5.
* The strategy guard: block-diagonal is never chosen, nor taken when asked for, above
  `block_diagonal_max_tokens`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from rose import Engine, EngineConfig, RaggedBatch
from rose.attention import sdpa
from rose.attention.sdpa import SdpaBackend, block_diagonal_max_tokens, choose_sdpa_strategy
from rose.loading import read_config, read_tensors
from rose.models import FamilyOptions, family_for
from rose.models.rows import WINDOW_QUERY_BLOCK, RowLayout

VOCAB = 1000
LONG = 32_768
MEDIUM = 4_096
PEAK_GROWTH_BOUND_MIB = 512  # see the module docstring: 1 GiB is one [L, L] bool mask
MODES = ("causal", "bidirectional")

# Runs in a fresh interpreter: argv = model directory, row length, sampled query rows.
_CHILD = r"""
import json, sys, time
import numpy as np, torch
from rose import Engine, RaggedBatch

path, length, samples = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = Engine.load(path)
rng = np.random.default_rng(0)
engine.step(RaggedBatch.from_lists([rng.integers(1, 1000, 16).tolist()])).wait()  # warm-up

backend, seen = engine.attention, []
plain_attend = backend.attend
def attend(q, k, v, state):
    out = plain_attend(q, k, v, state)
    if not seen:
        seen.append((q, k, v, out))  # the first layer's
    return out
backend.attend = attend

row = rng.integers(1, 1000, length).tolist()
batch = RaggedBatch.from_lists([row], pooling=["mean"], normalize=[False])
def status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
before = status_kib("VmRSS")
start = time.perf_counter()
pooled = engine.step(batch).wait()
seconds = time.perf_counter() - start
after = status_kib("VmHWM")

q, k, v, out = (t.double() for t in seen[0])  # [L, heads or kv_heads, D]
group = q.shape[1] // k.shape[1]
k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
picks = sorted({0, length - 1, *rng.integers(0, length, samples - 2).tolist()})
err = 0.0
for i in picks:
    keys = i + 1 if backend.causal else length
    scores = torch.einsum("hd,khd->hk", q[i], k[:keys]) / q.shape[-1] ** 0.5  # [heads, keys]
    want = torch.einsum("hk,khd->hd", scores.softmax(-1), v[:keys])  # [heads, D]
    err = max(err, (out[i] - want).abs().max().item())
print(json.dumps({
    "growth_mib": (after - before) / 1024,
    "rss_before_mib": before / 1024,
    "seconds": seconds,
    "attention_err": err,
    "finite": bool(torch.isfinite(pooled).all()),
    "shape": list(pooled.shape),
    "strategy": backend.describe(),
}))
"""


def _qwen3_config() -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # grouped-query attention
        head_dim=16,
        max_position_embeddings=40_960,  # Qwen3-Embedding's
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, dict[str, Path]]:
    """The transformers model and its directories by attention mode (no sentence-transformers
    files: the rows ask for mean pooling themselves)."""
    torch.manual_seed(22)
    model = transformers.Qwen3Model(_qwen3_config()).eval()
    root = tmp_path_factory.mktemp("long-qwen3")
    dirs = {mode: root / mode for mode in MODES}
    for path in dirs.values():
        model.save_pretrained(path)
    raw = json.loads((dirs["bidirectional"] / "config.json").read_text())
    raw.update(
        model_type="bidirectional_pplx_qwen3",
        architectures=["PPLXQwen3Model"],
        use_bidirectional_attention=True,
    )
    (dirs["bidirectional"] / "config.json").write_text(json.dumps(raw))
    return model, dirs


def _row(seed: int, n: int, low: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(low, VOCAB, size=n).tolist()


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset"
)
@pytest.mark.parametrize("mode", MODES)
def test_32k_row_embeds_in_linear_memory(qwen3, mode: str) -> None:
    _, dirs = qwen3
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(dirs[mode]), str(LONG), "64"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{mode} {LONG} tokens: {result}")  # pytest -s shows the measured numbers
    assert result["shape"] == [1, 32] and result["finite"]
    assert ("causal" in result["strategy"]) == (mode == "causal")
    assert result["growth_mib"] < PEAK_GROWTH_BOUND_MIB, result
    assert result["attention_err"] < 1e-5, result


def _reference_mean(model: torch.nn.Module, row: list[int], causal: bool) -> torch.Tensor:
    """transformers' mean-pooled last hidden states [H] of one row, causal or bidirectional."""
    n = len(row)
    kwargs = {} if causal else {"attention_mask": torch.zeros(1, 1, n, n)}  # attend everywhere
    with torch.no_grad():
        return model(input_ids=torch.tensor([row]), **kwargs).last_hidden_state[0].mean(0)


@pytest.mark.parametrize("mode", MODES)
def test_long_row_matches_transformers_and_batched_equals_alone(qwen3, mode: str) -> None:
    model, dirs = qwen3
    long_row = _row(1, MEDIUM)
    want = _reference_mean(model, long_row, causal=mode == "causal")
    rows = [_row(2, 7), long_row, _row(3, 1), _row(4, 33)]
    for strategy in ("auto", "block-diagonal"):
        engine = Engine.load(dirs[mode], EngineConfig(sdpa_strategy=strategy))
        cu = np.concatenate(([0], np.cumsum([len(r) for r in rows])))
        assert engine.attention.plan(cu).strategy == "per-sequence"  # T > the CPU cap

        def embed(batch_rows: list[list[int]], engine: Engine = engine) -> torch.Tensor:
            n = len(batch_rows)
            return engine.step(
                RaggedBatch.from_lists(batch_rows, pooling=["mean"] * n, normalize=[False] * n)
            ).wait()

        alone = embed([long_row])[0]
        torch.testing.assert_close(alone, want, atol=1e-4, rtol=0)
        batched = embed(rows)
        torch.testing.assert_close(batched[1], alone, atol=1e-5, rtol=0)
        for i in (0, 2, 3):
            torch.testing.assert_close(batched[i], embed([rows[i]])[0], atol=1e-5, rtol=0)


def test_windowed_long_row_attends_by_query_blocks(tmp_path: Path) -> None:
    """ModernBERT's local layers (window 8 either side) over a row of 2.5 query blocks."""
    torch.manual_seed(5)
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=80,
        max_position_embeddings=2048,
        local_attention=16,
        global_attn_every_n_layers=3,
        global_rope_theta=1000.0,
        local_rope_theta=50.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        cls_token_id=0,
        sep_token_id=2,
    )
    reference = transformers.ModernBertModel(config).eval()
    with torch.no_grad():  # far from uniform attention, so the window's edge counts
        for p in reference.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    reference.save_pretrained(tmp_path)
    raw = read_config(tmp_path)
    family = family_for(raw)
    cfg = family.config(raw, FamilyOptions())
    with torch.device("meta"):
        model = family.model(cfg)
    model.load_state_dict(family.load_weights(cfg, read_tensors(tmp_path)), assign=True)
    model.eval().requires_grad_(False)

    def hidden(rows: list[list[int]], strategy: str) -> list[torch.Tensor]:
        ids = np.array([t for r in rows for t in r], dtype=np.int64)
        cu = np.concatenate(([0], np.cumsum([len(r) for r in rows]))).astype(np.int64)
        positions = torch.from_numpy(family.position_ids(cfg, ids, cu))
        backend = SdpaBackend(strategy)
        layout = RowLayout.build(positions, backend)
        assert len(layout.blocks) == (1 if strategy == "block-diagonal" else len(rows))
        with torch.inference_mode():
            out = model.encoder(torch.from_numpy(ids), positions, None, backend, None)
        return [out[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]

    n = 2 * WINDOW_QUERY_BLOCK + WINDOW_QUERY_BLOCK // 2
    long_row = [0, *_row(6, n - 2, low=5), 2]  # no special ids inside
    alone = hidden([long_row], "per-sequence")[0]
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([long_row])).last_hidden_state[0]
    torch.testing.assert_close(alone, want, atol=1e-4, rtol=0)
    batched = hidden([[0, 5, 2], long_row, [0, 9, 9, 2]], "block-diagonal")  # T < the cap
    torch.testing.assert_close(batched[1], alone, atol=1e-5, rtol=0)


def test_block_diagonal_is_never_chosen_over_the_token_cap(monkeypatch) -> None:
    cpu_cap, cuda_cap = block_diagonal_max_tokens("cpu"), block_diagonal_max_tokens("cuda")
    # Make calls look so dear that the CPU cost model alone would always pick block-diagonal.
    monkeypatch.setattr(sdpa, "CALL_COST_IN_PAIRS", 10**12)
    assert choose_sdpa_strategy(np.full(cpu_cap // 4, 4)) == "block-diagonal"
    assert choose_sdpa_strategy(np.full(cpu_cap // 4 + 1, 4)) == "per-sequence"
    assert choose_sdpa_strategy(np.array([LONG, 1, 1])) == "per-sequence"
    assert choose_sdpa_strategy(np.full(cuda_cap // 8, 8), "cuda") == "block-diagonal"
    assert choose_sdpa_strategy(np.array([cuda_cap, 1]), "cuda") == "per-sequence"
    assert choose_sdpa_strategy(np.array([LONG]), "cuda") == "per-sequence"

    # Asked for explicitly, it still is not taken over the cap (outside a CUDA graph slot).
    backend = SdpaBackend("block-diagonal")
    small, big = np.array([0, 3, cpu_cap]), np.array([0, 3, cpu_cap + 1])
    assert backend.plan(small).strategy == "block-diagonal"
    assert backend.plan(big).strategy == "per-sequence"
    assert backend.plan(big, slot=(2, cpu_cap + 1)).strategy == "block-diagonal"
    positions = torch.cat([torch.arange(3), torch.arange(cpu_cap - 2)])  # two rows, T = cap + 1
    blocks = RowLayout.build(positions, backend).blocks
    assert [(b.span.start, b.span.stop, b.same_row) for b in blocks] == [
        (0, 3, None),
        (3, cpu_cap + 1, None),
    ]


@pytest.mark.parametrize("causal", (False, True))
def test_kv_heads_repeated_where_the_fused_kernel_takes_no_gqa(monkeypatch, causal: bool) -> None:
    """An older PyTorch whose flash kernel refuses ``enable_gqa`` would run SDPA's math kernel
    ([heads, L, L] scores); the backend then repeats the k/v heads itself. Same result."""
    assert isinstance(sdpa.fused_kernel_takes_gqa("cpu"), bool)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(45, n, 16, generator=gen) for n in (4, 2, 2))  # [T, heads, D]
    cu = np.array([0, 5, 45])
    backend = SdpaBackend("per-sequence", causal=causal)
    want = backend.attend(q, k, v, backend.plan(cu))
    monkeypatch.setattr(sdpa, "fused_kernel_takes_gqa", lambda device_type: False)
    got = backend.attend(q, k, v, backend.plan(cu))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
