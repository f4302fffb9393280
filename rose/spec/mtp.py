"""MTP / EAGLE-style draft head: one transformer layer on the target's features.

Input pair ``t`` is the target's final hidden state at position ``t`` and the embedding of
token ``t + 1`` (inputs shifted by one); each is RMS-normalized, concatenated and projected
back to the model width, then one decoder block (its own paged KV cache, pages from the
shared allocator) and an RMSNorm produce a feature whose logits come from the target's
LM head: the prediction for token ``t + 2``. The head shares the target's embeddings and LM
head. Chained drafting feeds the head's own output feature as the next pair's hidden state.

Saved as ``model.safetensors`` + ``config.json`` (`MTPHeadConfig`) in a directory.

`MTPProposer` is the engine's `rose.spec.proposer.Proposer` for it: the head's cache per
request (``Request.draft_table``) holds pairs built from target features only, never from
the head's own drafts once a pass is verified; the target features of verified tokens not
yet fed to the head wait in the request's `MTPState`. Greedy chains may be accepted on the
device with the next chain drafted in the same step (`MTPProposer.chains_on_device`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rose.attention.metadata import AttentionMetadata, PageLists, to_device
from rose.kv.allocator import OutOfPages, PageAllocator
from rose.kv.block_table import BlockTable
from rose.kv.cache import PagedKVCache
from rose.models.llama import (
    Block,
    LlamaConfig,
    LlamaForCausalLM,
    RMSNorm,
    RopeTable,
    rope_inv_freq,
)
from rose.packed import PackedLinear, can_pack, pack_linears
from rose.quant import Int4Linear, int4_available, int4_fits, quantize_linears
from rose.sampling import SamplingParams, sample, token_probs
from rose.spec.draft_model import ModelDrafter
from rose.spec.ngram import NgramDrafter
from rose.spec.proposer import Proposal, ProposerInputs, Verified
from rose.spec.tree import DraftTree, DynamicTree

if TYPE_CHECKING:
    from rose.runner import PassOutput
    from rose.scheduler import Request, Scheduled
    from rose.spec.config import SpecConfig

__all__ = [
    "MTPDraftRequest",
    "MTPDrafter",
    "MTPHead",
    "MTPHeadConfig",
    "MTPProposer",
    "MTPState",
    "draft_dtype",
]

_FORMAT = "trellis-mtp-head/1"


@dataclass(frozen=True)
class MTPHeadConfig:
    """Shape of the head; must match its target's width, heads and vocabulary.

    draft_vocab_size: the head drafts only among this many target tokens (the ids are the
    head's ``draft_vocab`` buffer, the target's most frequent output tokens), so a draft
    step multiplies by a ``[draft_vocab_size, H]`` slice of the LM head instead of all of
    it; 0 drafts over the whole vocabulary. Verification by the target stays exact either way.

    feature_layers: the target layers whose outputs feed the head (EAGLE-3 style: a low, a
    middle and a high layer, side by side ``[T, len * H]``, each RMS-normalized, then
    reduced to ``H`` by the head's ``reduce`` layer); empty: the target's final-norm hidden
    state, as heads saved before this field. A single layer is not allowed: its width would
    equal the head's own feature, which chained drafting feeds back in its place.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    draft_vocab_size: int = 0
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        layers = self.feature_layers
        if not isinstance(layers, tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers
        ):
            raise ValueError(
                f"mtp head config.feature_layers must be a tuple of ints, got {layers!r}"
            )
        if len(layers) == 1:
            raise ValueError(
                f"mtp head config.feature_layers must name no layer or at least two, got {layers}"
            )
        if any(i < 0 for i in layers) or any(
            b <= a for a, b in zip(layers, layers[1:], strict=False)
        ):
            raise ValueError(
                f"mtp head config.feature_layers must be ascending layer indices >= 0, got {layers}"
            )
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"mtp head config.draft_vocab_size must be in [0, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size}"
            )

    @property
    def feature_width(self) -> int:
        """Width of the target features the head takes: ``len(feature_layers) * H`` or H."""
        return self.hidden_size * max(1, len(self.feature_layers))

    @property
    def target_request(self) -> bool | tuple[int, ...]:
        """What the target's forward must be asked for (its ``return_all_hidden``)."""
        return self.feature_layers or True

    @staticmethod
    def for_target(
        cfg: LlamaConfig, draft_vocab_size: int = 0, feature_layers: tuple[int, ...] = ()
    ) -> MTPHeadConfig:
        return MTPHeadConfig(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            draft_vocab_size=draft_vocab_size,
            feature_layers=tuple(feature_layers),
        )

    def check_target(self, cfg: LlamaConfig) -> None:
        for key in ("hidden_size", "vocab_size"):
            if getattr(self, key) != getattr(cfg, key):
                raise ValueError(
                    f"mtp head config.{key}={getattr(self, key)} does not match the "
                    f"target's {getattr(cfg, key)}"
                )
        if self.feature_layers and self.feature_layers[-1] >= cfg.num_hidden_layers:
            raise ValueError(
                f"mtp head config.feature_layers={self.feature_layers} names a layer the "
                f"target's {cfg.num_hidden_layers} layers do not have"
            )

    def block_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )

    @staticmethod
    def from_dict(d: dict[str, Any]) -> MTPHeadConfig:
        if d.get("format") != _FORMAT:
            raise ValueError(f"mtp head config.format must be {_FORMAT!r}, got {d.get('format')!r}")
        fields = {k: d[k] for k in MTPHeadConfig.__dataclass_fields__ if k in d}
        if isinstance(fields.get("feature_layers"), list):  # JSON has no tuples
            fields["feature_layers"] = tuple(fields["feature_layers"])
        return MTPHeadConfig(**fields)


class MTPHead(nn.Module):
    def __init__(self, cfg: MTPHeadConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fuse = nn.Linear(2 * h, h, bias=False)
        n_layers = len(cfg.feature_layers)
        if n_layers:  # multi-layer target features: normalize each, then reduce to H
            self.layer_norms = nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in range(n_layers))
            self.reduce = nn.Linear(n_layers * h, h, bias=False)
        self.block = Block(cfg.block_config(), layer=0)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # target token id of each draft-vocabulary row (identity when drafting over all)
        n = cfg.draft_vocab_size or cfg.vocab_size
        self.register_buffer("draft_vocab", torch.arange(n, dtype=torch.int64))
        self._rope_table: RopeTable | None = None  # built for the cache it writes to

    def lm_weight(self, target_output: torch.Tensor) -> torch.Tensor:
        """The rows of the target's LM head weight ``[V, H]`` the head drafts among."""
        if self.config.draft_vocab_size == 0:
            return target_output
        return target_output[self.draft_vocab].contiguous()  # [N, H]

    def new_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        w = self.norm.weight  # dtype and device (the linear layers may be packed)
        c = self.config
        return PagedKVCache(
            1, c.num_key_value_heads, c.head_dim, num_pages, page_size, w.dtype, w.device
        )

    def forward(
        self,
        hidden: torch.Tensor,
        token_emb: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """hidden (target features at t ``[T, feature_width]``, or the head's own output
        feature ``[T, H]`` when chaining), token_emb ``[T, H]`` (embedding of token t + 1)
        → feature ``[T, H]`` (normed; logits = target LM head of it)."""
        cos, sin = self._rope(cache, hidden)(meta.positions)
        x = self.block(self.fuse_inputs(hidden, token_emb), cos, sin, meta, cache)  # [T, H]
        return self.norm(x)

    def _rope(self, cache: PagedKVCache, hidden: torch.Tensor) -> RopeTable:
        """The rotary table for positions in ``cache`` (one per slot at most), rebuilt when
        the cache, device or dtype changes."""
        table = self._rope_table
        slots = cache.k.shape[1]
        if (
            table is None
            or len(table) < slots
            or table.table.device != hidden.device
            or table.table.dtype != hidden.dtype
        ):
            inv_freq = rope_inv_freq(self.config.block_config()).to(hidden.device)
            table = self._rope_table = RopeTable(inv_freq, slots, hidden.dtype)
        return table

    def fuse_inputs(self, hidden: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """The block's input ``[T, H]`` from a feature (target ``[T, feature_width]`` or own
        ``[T, H]``) and the next token's embedding ``[T, H]``."""
        h = self.config.hidden_size
        if hidden.shape[-1] != h:
            if hidden.shape[-1] != self.config.feature_width:
                raise ValueError(
                    f"mtp head features must be {self.config.feature_width} or {h} wide, "
                    f"got {hidden.shape[-1]}"
                )
            parts = hidden.split(h, dim=-1)  # len(feature_layers) x [T, H]
            normed = [n(p) for n, p in zip(self.layer_norms, parts, strict=True)]
            hidden = self.reduce(torch.cat(normed, dim=-1))  # [T, H]
        x = torch.cat([self.embed_norm(token_emb), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        return self.fuse(x)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        meta = {"format": _FORMAT, **asdict(self.config), **(extra or {})}
        (path / "config.json").write_text(json.dumps(meta, indent=2) + "\n")

    @staticmethod
    def load(path: str | Path, dtype: torch.dtype = torch.float32) -> MTPHead:
        path = Path(path)
        cfg = MTPHeadConfig.from_dict(json.loads((path / "config.json").read_text()))
        head = MTPHead(cfg)
        state = load_file(str(path / "model.safetensors"))
        want = {k: tuple(v.shape) for k, v in head.state_dict().items()}
        if cfg.draft_vocab_size == 0 and "draft_vocab" not in state:
            state["draft_vocab"] = head.draft_vocab  # heads saved before draft vocabularies
        got = {k: tuple(v.shape) for k, v in state.items()}
        if want != got:
            raise ValueError(f"mtp head weights in {path}: expected {want}, got {got}")
        head.load_state_dict(state, strict=True)
        return head.to(dtype).eval()


@dataclass
class MTPDraftRequest:
    """table: the head's cache for this sequence (holds pairs ``0 .. table.length - 1``).
    features: target features ``[n, config.feature_width]`` for pairs ``table.length ..``
    up to the sequence's last cached position; tokens: all tokens so far; k: drafts wanted."""

    table: BlockTable
    features: torch.Tensor
    tokens: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator | None


def draft_int4(setting: str, head: MTPHead) -> bool:
    """Whether a `SpecConfig.draft_dtype` setting gives ``head`` int4 weights (`rose.quant`):
    "int4", or "auto" on a CPU with the int4 kernel where the head drafts in bf16."""
    on_cpu = head.norm.weight.device.type == "cpu"
    if setting == "int4":
        if not (on_cpu and int4_available()):
            raise ValueError(
                "spec.draft_dtype='int4' needs a CPU head and PyTorch's CPU int4 kernel "
                "(aten._weight_int4pack_mm_for_cpu)"
            )
        return True
    return (
        setting == "auto"
        and on_cpu
        and int4_available()
        and draft_dtype(setting, head) == torch.bfloat16
    )


def draft_dtype(setting: str, head: MTPHead) -> torch.dtype:
    """The dtype a `SpecConfig.draft_dtype` setting resolves to for ``head``: that of the
    activations going into the products when the weights are int4 (`draft_int4`)."""
    own = head.norm.weight.dtype
    if setting == "float32":
        return torch.float32
    if setting in ("bfloat16", "int4"):
        return torch.bfloat16
    device = head.norm.weight.device
    if device.type == "cuda":
        fast_bf16 = torch.cuda.is_bf16_supported()
    else:
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        fast_bf16 = device.type == "cpu" and probe is not None and bool(probe())
    return torch.bfloat16 if fast_bf16 and own in (torch.float32, torch.bfloat16) else own


def _for_inference(head: MTPHead, dtype: torch.dtype, int4: bool = False) -> MTPHead:
    """The head the drafter runs: a frozen copy whose linear layers hold ``dtype`` weights,
    with q/k/v and gate/up fused (the caller's head stays trainable and unchanged). On CPU
    the linear layers are oneDNN-packed (`rose.packed`) and only they change dtype: a bf16
    product under fp32 activations, norms, cache and attention, because PyTorch's CPU
    attention is ~8x slower in bf16 than in fp32 for a one-token query. With ``int4`` the
    layers the kernel takes are then quantized from those ``dtype`` weights instead of
    packed (`rose.quant`). Elsewhere (CUDA) the whole copy moves to ``dtype``."""
    copy = deepcopy(head).requires_grad_(False)
    copy.block.attention.fuse_qkv()  # one product for q, k and v, one for gate and up
    copy.block.mlp.fuse_gate_up()
    probe = copy.fuse.weight.detach().to(dtype)
    packs = can_pack(probe)
    if not packs:
        copy = copy.to(dtype)
    for module in copy.modules():
        if isinstance(module, nn.Linear):
            module.to(dtype)
    if int4:
        quantize_linears(copy)
    if packs:
        pack_linears(copy, batch_hint=4, single_row=True)  # the layers left dense
    return copy


def _draft_lm_head(weight: torch.Tensor, int4: bool = False) -> nn.Module:
    """``x @ weight.T`` for the draft-vocabulary rows ``[N, H]``: a `PackedLinear` where
    oneDNN can pack the weight (faster than ``mm`` for a cold bf16 weight: 359 vs 453 µs for
    4096 x 576 on one thread), else a plain linear layer."""
    if int4 and int4_fits(weight):
        return Int4Linear(weight)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return PackedLinear(linear, batch_hint=4) if can_pack(weight) else linear


class MTPDrafter:
    """Drafts a chain of k tokens per sequence with an `MTPHead`, all sequences batched."""

    def __init__(
        self,
        head: MTPHead,
        target: LlamaForCausalLM,
        allocator: PageAllocator,
        page_size: int,
        dtype: torch.dtype | None = None,
        int4: bool = False,
    ) -> None:
        head.config.check_target(target.config)
        # of the linear layers' weights (with int4, of the activations going into them)
        self.dtype = dtype or head.norm.weight.dtype
        self.head = _for_inference(head, self.dtype, int4)
        self.target = target
        self.allocator = allocator
        self.page_size = page_size
        self.cache = self.head.new_cache(allocator.num_pages, page_size)
        # the product with the LM head rows the head drafts among ([N, H], sliced once),
        # packed for oneDNN where it can be (rose.packed)
        rows = head.lm_weight(target.output.weight.detach()).to(self.dtype)
        self.lm_head: nn.Module = _draft_lm_head(rows, int4)

    def new_table(self) -> BlockTable:
        return BlockTable(self.allocator, self.page_size)

    def chain_room(self, cached: int, fed: int, k: int) -> int:
        """Tokens a head table must hold for `chain_after_verify` (``fed`` pairs from
        position ``cached``, then up to ``k - 1`` chained pairs past the last of them)."""
        return cached + fed + k - 1

    @torch.no_grad()
    def chain_after_verify(
        self,
        tables: Sequence[BlockTable],
        cached: Sequence[int],
        fed: Sequence[Sequence[int]],
        features: torch.Tensor,
        last_verified: torch.Tensor,
        bonus: torch.Tensor,
        k: int,
        min_prob: float = 0.0,
    ) -> torch.Tensor:
        """Greedy chains of ``k`` drafts right after a verification pass, without reading
        its outcome back to the host: what is accepted stays on the device.

        Sequence ``b`` fed the target tokens ``fed[b]`` from position ``cached[b]`` (its head
        table holds exactly the pairs before it and has room for `chain_room`); its
        verified tokens are rows ``0 .. last_verified[b]`` of them (``[B]``, on the device),
        and ``bonus[b]`` is the target's token after them. ``features [T, W]`` are the
        pass's target features in feed order. Returns the drafts ``[B, k]`` (target ids) on
        the device; the caller sets each table's length once it knows the outcome.
        ``min_prob`` (`SpecConfig.chain_min_prob`): every chain still runs all ``k`` steps
        (fixed shapes), then drafts past the first one at which the head's probability for
        the chain falls below it are -1, the same chain the host path's early stop drafts.

        Step 0 feeds every fed row's pair (row r: feature r and token r + 1, the bonus at
        the last verified row) with fixed shapes, so no count from the device decides a
        shape; rows past the last verified one only write cache entries that the chain's
        later steps overwrite before anything reads them (keys are masked by position).
        Equal to `propose` on the verified rows alone: attention is causal.
        """
        dev = self.cache.k.device
        emb = self.target.tok_embeddings
        counts = [len(f) for f in fed]
        starts = to_device(torch.tensor([sum(counts[:i]) for i in range(len(counts))]), dev)
        ids = to_device(torch.tensor([t for f in fed for t in (*f[1:], 0)]), dev)  # [T]
        rows = starts + last_verified  # [B] flat row of each sequence's last verified pair
        ids = ids.index_put((rows,), bonus)
        entries = [(t, c, n) for t, c, n in zip(tables, cached, counts, strict=True)]
        meta = AttentionMetadata.build(entries, device=dev)
        feat = self.head(features, emb(ids), meta, self.cache)[rows]  # [B, H]
        best, prob = self._best(feat, bool(min_prob))
        drafts, probs = [best], [prob]  # [B] each
        if k > 1:
            b = len(tables)
            reach = [self.chain_room(c, n, k) for c, n in zip(cached, counts, strict=True)]
            slots = torch.zeros(b, max(reach), dtype=torch.int64)  # [B, Lk], padding slot 0
            for i, t in enumerate(tables):
                slots[i, : reach[i]] = t.slots(0, reach[i])
            slots = to_device(slots, dev)
            keys = torch.arange(slots.shape[1], device=dev)  # [Lk] key positions
            one = torch.arange(b, device=dev)
            pages = PageLists.of([(t, 0, r) for t, r in zip(tables, reach, strict=True)])
            last = to_device(torch.tensor(list(cached)), dev) + last_verified  # [B] positions
            for step in range(1, k):
                pos = last + step  # [B]
                meta = AttentionMetadata(
                    positions=pos,
                    slot_mapping=slots.gather(1, pos[:, None]).squeeze(1),
                    q_index=one[:, None],
                    out_index=one,
                    kv_slots=slots,
                    mask=(keys[None, :] <= pos[:, None])[:, None, None, :],  # [B, 1, 1, Lk]
                    last_index=one,
                    cu_seqlens=torch.arange(b + 1, device=dev),
                    pages=pages,
                    causal=False,
                )
                feat = self.head(feat, emb(drafts[-1]), meta, self.cache)  # [B, H]
                best, prob = self._best(feat, bool(min_prob))
                drafts.append(best)
                probs.append(prob)
        chains = torch.stack(drafts, dim=1)  # [B, k]
        if not min_prob:
            return chains
        below = torch.stack(probs, dim=1).cumprod(1) < min_prob  # type: ignore[arg-type]
        # a chain keeps its drafts through the first one below min_prob (argmax: first True)
        stop = torch.where(below.any(1), below.to(torch.int64).argmax(1), k - 1)  # [B]
        past = torch.arange(k, device=dev)[None, :] > stop[:, None]  # [B, k]
        return chains.masked_fill(past, -1)

    def _best(
        self, feat: torch.Tensor, with_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's greedy token (target id) for features ``[B, H]``: ``[B]``, and with
        ``with_prob`` its probability ``[B]`` (as `propose` computes it), else None."""
        logits = self.lm_head(feat.to(self.dtype)).float()  # [B, N] over the draft vocabulary
        if not with_prob:
            return self.head.draft_vocab[logits.argmax(-1)], None
        top = torch.softmax(logits, -1).max(-1)
        return self.head.draft_vocab[top.indices], top.values

    @torch.no_grad()
    def propose(
        self,
        requests: list[MTPDraftRequest],
        widths: Sequence[int] = (),
        nodes: int = 0,
        min_prob: float = 0.0,
    ) -> list[tuple[list[int], torch.Tensor | None, list[list[int]]]]:
        """Chains of drafts per request, their distributions ``q [k, V]`` (None for
        greedy requests, whose drafts are the head's argmax: q is one-hot at them) and, for
        greedy requests, the alternatives at each depth of a draft tree
        (`rose.spec.tree.DraftTree`; empty lists without one):

        - ``widths``: a static tree, the head's next ``widths[d] - 1`` best tokens at depth
          ``d + 1``;
        - ``nodes``: a dynamic tree of that many nodes, chosen by the head's own path
          probabilities (`rose.spec.tree.DynamicTree`): the chain grows only while its tip
          is likely enough for its children to make the cut, so an unsure head spends its
          nodes on alternatives at depth 1 and skips the head steps it would have wasted.

        ``min_prob`` (greedy chains, without a tree): a chain stops growing once the head's
        probability for all of it, the product of its drafts' probabilities, is below this;
        its ``k`` is then the longest it may get (`SpecConfig.chain_min_prob`).
        """
        vocab = self.target.config.vocab_size
        emb = self.target.tok_embeddings
        draft_vocab = self.head.draft_vocab
        live: list[int] = []
        for i, r in enumerate(requests):
            n = r.features.shape[0]
            if n < 1:
                continue
            try:
                r.table.reserve(r.table.length + n + r.k - 1)
                live.append(i)
            except OutOfPages:
                pass
        drafts: list[list[int]] = [[] for _ in requests]
        dists: list[list[torch.Tensor]] = [[] for _ in requests]
        alts: list[list[list[int]]] = [[] for _ in requests]
        dynamic = {i: DynamicTree(nodes) for i in live if nodes and requests[i].params.greedy}
        # step 0 feeds the pending target features with the tokens that follow them
        feats = {i: requests[i].features for i in live}
        toks: dict[int, list[int]] = {}
        for i in live:
            r = requests[i]
            start = r.table.length + 1  # pair t pairs feature t with token t + 1
            toks[i] = r.tokens[start : start + r.features.shape[0]]
        # A greedy chain keeps its drafts on the device until the last step: each head step
        # feeds on the previous step's argmax there, and one read at the end brings the
        # whole chain back (on a GPU, no host synchronization between the head's steps).
        on_device = (
            not widths
            and not nodes
            and not min_prob
            and all(requests[i].params.greedy for i in live)
        )
        # the head's probability for each greedy chain so far, when chains stop below min_prob
        chain_prob = {i: 1.0 for i in live if min_prob and requests[i].params.greedy}
        chain: list[tuple[list[int], torch.Tensor]] = []  # (live, [B] draft ids) per step
        for step in range(max((requests[i].k for i in live), default=0)):
            live = [
                i
                for i in live
                if requests[i].k > step
                and (i not in dynamic or dynamic[i].grows)
                and chain_prob.get(i, 1.0) >= min_prob
            ]
            if not live:
                break
            fed = {i: 1 if on_device and step else len(toks[i]) for i in live}
            entries = [(requests[i].table, requests[i].table.length, fed[i]) for i in live]
            meta = AttentionMetadata.build(entries, device=self.cache.k.device)
            if on_device and step:
                prev_live, prev_ids = chain[-1]
                rows = [prev_live.index(i) for i in live]
                ids = prev_ids if len(rows) == len(prev_live) else prev_ids[rows]
            else:
                ids = torch.tensor([t for i in live for t in toks[i]], device=self.cache.k.device)
            hid = feats[live[0]] if len(live) == 1 else torch.cat([feats[i] for i in live])
            out = self.head(hid, emb(ids), meta, self.cache)
            if out.shape[0] != len(live):
                out = out[meta.last_index]  # [B, H]
            # [B, N] over the draft vocabulary (the product in the weights' dtype)
            logits = self.lm_head(out.to(self.dtype)).float()
            if on_device:
                chain.append((live, draft_vocab[logits.argmax(-1)]))  # [B] target ids
                for row, i in enumerate(live):
                    requests[i].table.length += fed[i]
                    feats[i] = out[row : row + 1]
                continue
            width = nodes or (widths[step] if step < len(widths) else 1)
            probs: list[list[float]] = []
            conf: list[float] = []
            if width > 1 or nodes:  # [B, width] target ids, best first, one sync
                top = (torch.softmax(logits, -1) if nodes else logits).topk(width, dim=-1)
                ranked = draft_vocab[top.indices].tolist()
                probs = top.values.tolist() if nodes else []
                best = [row[0] for row in ranked]
            elif chain_prob:  # the head's probability of each best token, same sync
                top = torch.softmax(logits, -1).max(-1)
                ranked, conf = [], top.values.tolist()
                best = draft_vocab[top.indices].tolist()
            else:
                ranked = []
                best = draft_vocab[logits.argmax(-1)].tolist()  # [B] target ids, one sync
            for row, i in enumerate(live):
                r = requests[i]
                r.table.length += len(toks[i])
                if r.params.greedy:
                    tok = best[row]
                    if i in dynamic:
                        dynamic[i].add(ranked[row], probs[row], can_grow=step + 1 < r.k)
                    elif widths:
                        alts[i].append(ranked[row][1:] if ranked else [])
                    elif i in chain_prob:
                        chain_prob[i] *= conf[row]
                else:  # sample within the draft vocabulary; q is zero outside it
                    q_sub = token_probs(logits[row : row + 1], r.params)  # [1, N]
                    j = int(sample(q_sub, r.params, r.generator)[0])
                    tok = int(draft_vocab[j])
                    q = torch.zeros(vocab, device=q_sub.device).index_copy_(
                        0, draft_vocab, q_sub[0]
                    )
                    dists[i].append(q)
                drafts[i].append(tok)
                feats[i] = out[row : row + 1]
                toks[i] = [tok]
        if chain:  # the chain's one read back to the host
            flat = torch.cat([ids for _, ids in chain]).tolist()
            at = 0
            for step_live, _ in chain:
                for row, i in enumerate(step_live):
                    drafts[i].append(flat[at + row])
                at += len(step_live)
        for i, tree in dynamic.items():
            drafts[i], alts[i] = tree.select()
        return [
            (drafts[i], torch.stack(dists[i]) if dists[i] else None, alts[i])
            for i in range(len(requests))
        ]


@dataclass
class MTPState:
    """A request's head-side state: features ``[n, feature_width]`` of the target for pairs
    ``draft_table.length ..`` not fed to the head yet (None: none), and the chain drafted on
    the device right after the last verification (None: none; `MTPProposer.settle`)."""

    features: torch.Tensor | None = None
    next_drafts: list[int] | None = None


class MTPProposer:
    """Chains (or, for greedy requests, draft trees) from an `MTPDrafter`."""

    kv_copies = 1

    def __init__(self, drafter: MTPDrafter, spec: SpecConfig) -> None:
        self.drafter = drafter
        self.spec = spec
        self.target_features = drafter.head.config.target_request
        # prompt lookup in place of the head on long matches (SpecConfig.lookup_min_match):
        # a drafter that matches only suffixes that long
        self.lookup = (
            NgramDrafter(spec.ngram_max, spec.lookup_min_match) if spec.lookup_min_match else None
        )

    @staticmethod
    def build(inputs: ProposerInputs) -> MTPProposer:
        head = inputs.mtp_head
        if head is None:
            raise ValueError("spec.method='mtp' needs an mtp_head")
        setting = inputs.spec.draft_dtype
        drafter = MTPDrafter(
            head,
            inputs.target,
            inputs.allocator,
            inputs.page_size,
            draft_dtype(setting, head),
            draft_int4(setting, head),
        )
        return MTPProposer(drafter, inputs.spec)

    def propose(self, todo: Sequence[tuple[Request, int]]) -> list[Proposal | None]:
        """A copy from the context where it ends in a long enough repeat (`lookup`), else
        the chains drafted at the end of the last step where there are some, else the head
        drafts from the features it has not seen yet (requests without any get none). A
        lookup leaves the head's cache as it is: the features of the tokens it kept queue
        behind those not fed yet (`accept`), and the head's next step feeds them all."""
        out: list[Proposal | None] = [None] * len(todo)
        reqs: list[MTPDraftRequest] = []
        owners: list[tuple[int, MTPState, int]] = []
        spec = self.spec
        for i, (r, room) in enumerate(todo):
            state = r.spec_state
            if state is None or r.draft_table is None:
                continue
            if self.lookup is not None:
                copied = self.lookup.propose(r.tokens, min(room, spec.lookup_drafts))
                if copied:
                    state.next_drafts = None  # the head's chain for this step goes unused
                    out[i] = Proposal(copied)
                    continue
            k = min(room, spec.num_draft_tokens)
            if state.next_drafts is not None:
                d, state.next_drafts = state.next_drafts[:k], None
                out[i] = Proposal(d) if d else None
            elif state.features is not None:
                reqs.append(
                    MTPDraftRequest(
                        r.draft_table, state.features, r.tokens, k, r.params, r.generator
                    )
                )
                owners.append((i, state, r.draft_table.length))
        if not reqs:
            return out
        proposals = self.drafter.propose(
            reqs, spec.tree_widths, spec.tree_nodes, spec.chain_min_prob
        )
        for (i, state, before), mr, (d, q, alts) in zip(owners, reqs, proposals, strict=True):
            if mr.table.length > before:
                state.features = None  # consumed into the head's cache
            if d and any(alts):
                tree = DraftTree(d, alts)
                out[i] = Proposal(tree.tokens, q, tree)
            elif d:
                out[i] = Proposal(d, q)
        return out

    def accept(self, request: Request, verified: Verified) -> None:
        """The head's cache keeps only pairs built from target features (the features of
        the kept tokens are queued to refill it)."""
        table = request.draft_table
        assert table is not None and verified.hidden is not None
        ModelDrafter.rollback(table, len(request.tokens) - 1)
        path, pending = verified.path, verified.pending
        if path and path[-1] != len(path) - 1:  # a tree's alternative: pending rows, then the path
            kept = [*range(pending), *(pending + j for j in path)]
            new = verified.hidden[kept]
        else:  # positions cached .. in feed order
            new = verified.hidden[: pending + len(path)]
        state = request.spec_state
        if state is None:
            state = request.spec_state = MTPState()
        state.features = new if state.features is None else torch.cat([state.features, new])

    # ------------------------------------------------------- chains on the device
    def chains_on_device(self, batch: Sequence[Scheduled]) -> bool:
        """Whether this step accepts on the device and drafts the next chains before
        anything is read back (`SpecConfig.device_chain`): every request greedy and yielding
        a token, plain chains, the head's cache holding exactly the pairs before the pass,
        and room reserved in every head table for the chain (`MTPDrafter.chain_room`)."""
        spec = self.spec
        wanted = spec.device_chain == "on" or (
            spec.device_chain == "auto" and self.drafter.cache.k.device.type != "cpu"
        )
        if (
            not wanted
            or spec.tree_widths
            or spec.tree_nodes
            or spec.adaptive_k
            or not all(s.request.params.greedy and s.emits for s in batch)
        ):
            return False
        for s in batch:
            head, state = s.request.draft_table, s.request.spec_state
            if head is None or head.length < s.cached:
                return False
            if state is not None and state.features is not None:
                return False  # features still to feed: the general path feeds them
        for s in batch:
            head = s.request.draft_table
            assert head is not None
            ModelDrafter.rollback(head, s.cached)  # the chain drafted for this pass
            fed = s.pending + len(s.drafts)
            try:
                head.reserve(self.drafter.chain_room(s.cached, fed, spec.num_draft_tokens))
            except OutOfPages:
                return False
        return True

    def outcome_on_device(self, batch: Sequence[Scheduled], out: PassOutput) -> torch.Tensor:
        """Accepted counts ``[B]``, bonus tokens ``[B]`` and the next drafts ``[B * k]`` (-1
        past where a chain stopped, `SpecConfig.chain_min_prob`), side by side on the
        device, from a verification pass: nothing is read back and no copy waits for the
        device, so on a GPU the head's steps queue right behind the pass
        (`MTPDrafter.chain_after_verify`)."""
        assert out.hidden is not None
        dev = out.logits.device
        chains = [s.drafts for s in batch]
        width = max(1, max(len(d) for d in chains))
        # per request: the logits rows checking its drafts, then its bonus row (the last
        # row repeated past a short chain), and its drafts (-1, no token, past them)
        at, want = [], []
        for d, row in zip(chains, out.rows, strict=True):
            n = len(d) + 1
            at.append([row + j for j in range(n)] + [row + n - 1] * (width + 1 - n))
            want.append(list(d) + [-1] * (width - len(d)))
        pred = out.logits.argmax(-1)[to_device(torch.tensor(at), dev)]  # [B, width + 1]
        hit = pred[:, :width] == to_device(torch.tensor(want), dev)  # [B, width]
        n_acc = hit.to(torch.int64).cumprod(1).sum(1)  # [B] leading drafts the target kept
        bonus = pred.gather(1, n_acc[:, None]).squeeze(1)  # [B] the target's next token
        pending = torch.tensor([s.pending for s in batch])
        last = to_device(pending, dev) - 1 + n_acc  # [B] row of the last verified token
        tables = [s.request.draft_table for s in batch]
        assert all(t is not None for t in tables)
        nxt = self.drafter.chain_after_verify(
            tables,  # type: ignore[arg-type]
            [s.cached for s in batch],
            [s.ids for s in batch],
            out.hidden,
            last,
            bonus,
            self.spec.num_draft_tokens,
            self.spec.chain_min_prob,
        )
        return torch.cat([n_acc, bonus, nxt.flatten()])

    def settle(self, batch: Sequence[Scheduled], back: list[int]) -> list[tuple[int, int]]:
        """(accepted drafts, next token) per request from `outcome_on_device` read back;
        each head table keeps the pairs of the verified tokens, each request its next chain."""
        k = self.spec.num_draft_tokens
        b = len(batch)
        outcomes = []
        for i, s in enumerate(batch):
            acc, tok = back[i], back[b + i]
            head = s.request.draft_table
            assert head is not None
            head.length = self.drafter.chain_room(s.cached, s.pending + len(s.drafts), k)
            head.truncate(s.cached + s.pending + acc)  # pairs built from target features only
            state = s.request.spec_state
            if state is None:
                state = s.request.spec_state = MTPState()
            state.next_drafts = [t for t in back[2 * b + i * k : 2 * b + (i + 1) * k] if t >= 0]
            outcomes.append((acc, tok))
        return outcomes
