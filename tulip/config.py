"""`TulipConfig`: the server's whole configuration, read once from flags and environment.

Every flag ``--some-flag`` can also be given as the environment variable
``TULIP_SOME_FLAG``; a flag on the command line wins over the environment. Values are
validated here, and every error names the flag it is about.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rose.assets.heads import BUNDLED, BundledHead, bundled_head_for

__all__ = ["ConfigError", "TulipConfig", "env_name"]

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_ATTENTION_MODES = ("auto", "causal", "bidirectional")
_QUANTIZE = ("none", "int8")
_SPEC_METHODS = ("none", "ngram", "draft", "mtp")
# `--spec mtp`'s drafts when no flag shapes them: a dynamic tree of 3 nodes up to 3 deep, so
# a verification pass feeds 4 tokens, as a chain of 3 does, and the head puts its third node
# where it is likelier kept. The fastest MTP row on both prompt sets on AMD Zen 5
# (bench/results/spec-zen5.md; SmolLM2-135M, one CPU thread: 1.49x median on chat, the best
# chain 1.44x; 1.18x on rag-quote, the best chain 1.12x); on Zen 4 (bench/results/spec.md)
# it ties a 5-node tree within this shared machine's noise (1.60x vs 1.67x median on chat,
# the best chain 1.57x).
_MTP_TREE_NODES = 3
_MTP_TREE_DEPTH = 3
# --spec mtp's default --spec-lookup: a 2-token repeat copies (bench/results/spec.md)
_MTP_LOOKUP = 2
_RUNNERS = ("auto", "generate", "pooling")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the flag."""


def env_name(flag: str) -> str:
    """``--max-batch-tokens`` -> ``TULIP_MAX_BATCH_TOKENS``."""
    return "TULIP_" + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class TulipConfig:
    """How one Tulip process serves one model."""

    model: str
    """A model directory, a bundled asset name or a Hub id ``owner/name[@revision]``
    (`rose.hub.resolve_model`)."""
    model_name: str = ""
    """Name reported by `Info`; empty means the model directory's basename."""
    host: str = "127.0.0.1"
    """Listen address of gRPC and metrics: loopback unless a deployment opens it (the
    containers set 0.0.0.0 and a NetworkPolicy lets only Ivy in): Tulip has no auth."""
    port: int = 50051
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """``auto`` (the engine's choice for the device), ``float32``, ``bfloat16`` or ``float16``.
    A reduced dtype on the CPU passes ROSE's accuracy gate at load or Tulip exits (`rose.int8`)."""
    quantize: str = "none"
    """``none`` or ``int8``: encoders on the CPU with int8 weights per output channel and
    activations quantized per sequence (`rose.int8`); refused at load when its cosine to float32
    on the check set is under 0.99. Needs float32 activations (``--dtype auto|float32``)."""
    max_batch_tokens: int = 0
    """Token budget of one encoder batch; 0: the backend's choice for its device (16384 on
    a GPU; 2048 on a CPU, where a bigger batch adds latency for every request in it and
    no throughput)."""
    max_batch_rows: int = 256
    max_queued_tokens: int = 262144
    max_queue_seconds: float = 1.0
    """Admission by time: refuse (RESOURCE_EXHAUSTED) work that would wait longer than this
    for the engine, by the engine's measured speed; 0 turns the time bound off."""
    runner: str = "auto"
    """How the model is served (vLLM's ``--runner``): ``generate`` (a decoder: chat and
    completions), ``pooling`` (an encoder: embeddings, scores) or ``auto``, which reads the
    model directory (`tulip.generation.is_generator`)."""
    cuda_graphs: bool = True
    attention_mode: str = "auto"
    """Encoders: ``auto`` (what the model directory says), ``causal`` or ``bidirectional``
    (decoder-based embedders such as Qwen3 run either way)."""
    metrics_port: int = 9100
    """Port of the Prometheus endpoint; 0 disables it."""
    drain_seconds: float = 30.0
    """Grace period after SIGTERM for queued and in-flight work."""
    threads: int | None = None
    """torch intra-op threads; None leaves torch's default (all cores)."""
    # -- generation (decoder models only) ---------------------------------------------
    max_running_seqs: int = 32
    """Most sequences decoded together (continuous batching); more wait in the engine."""
    kv_pages: int = 0
    """Pages in the KV cache pool; 0 sizes it for two full-context sequences."""
    kv_page_size: int = 16
    """Tokens per KV cache page."""
    prefix_cache: bool = True
    """Reuse the KV pages of prompt prefixes seen before (`rose.kv.prefix`); with ``--spec
    draft`` / ``mtp`` it stays off (their own per-token state is not cached)."""
    spec: str = "none"
    """Speculative decoding: ``none``, ``ngram`` (prompt lookup), ``draft`` or ``mtp``."""
    spec_draft_tokens: int = 0
    """Tokens proposed per step when speculating, the most per step with adaptive drafts;
    0: by method (`draft_tokens`)."""
    spec_adaptive: bool = False
    """Adaptive drafts (`SpecConfig.adaptive_k`): a sequence drafts 2 more tokens after a step
    that kept all of its drafts and 1 fewer after a rejection."""
    spec_ngram_per_match: int | None = None
    """``--spec ngram``: draft at most this many tokens per token of the suffix the lookup
    matched (`SpecConfig.ngram_draft_per_match`), ``--spec-draft-tokens`` being the most;
    0: always ``--spec-draft-tokens``; None: 4, so a 4-token match drafts 16
    (bench/results/spec.md)."""
    spec_tree: str = ""
    """``--spec mtp``: widths of a draft tree per depth, e.g. ``3,2`` (greedy requests verify
    the head's 3 best tokens at depth 1 and 2 at depth 2; `rose.spec.tree`); empty: chain."""
    spec_tree_nodes: int | None = None
    """``--spec mtp``: a dynamic draft tree of this many nodes picked by the head's own
    probabilities, up to ``--spec-draft-tokens`` deep (instead of ``--spec-tree``); 0: chains;
    None: by method (`tree_nodes`)."""
    spec_chain_min_prob: float = 0.0
    """``--spec mtp``, chains: stop a sequence's chain once the head's probability for all of
    it falls below this, ``--spec-draft-tokens`` being the longest (`SpecConfig.chain_min_prob`);
    0: fixed-length chains."""
    spec_lookup: int | None = None
    """``--spec mtp``: a step whose context ends in a repeat of this many tokens or more (up
    to 4) copies what followed the earlier occurrence, up to ``--spec-lookup-drafts``
    tokens, instead of asking the head (`SpecConfig.lookup_min_match`); 0: off; None:
    `_MTP_LOOKUP`."""
    spec_lookup_drafts: int = 5
    """``--spec mtp`` with lookups: tokens a lookup copies at most (`SpecConfig.lookup_drafts`)."""
    draft_model: str = ""
    """``--spec draft``: the drafter's model (directory, asset name or Hub id; same tokenizer)."""
    draft_layers: int = 0
    """``--spec draft`` without ``--draft-model``: the target's first N layers as drafter."""
    mtp_head: str = ""
    """``--spec mtp``: directory of a head trained by ``python -m rose.spec.train_mtp``; empty:
    the head Trellis ships for ``--model`` (`rose.assets.heads`), if there is one."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required (a model directory or an asset name)")
        if not self.host:
            raise ConfigError("--host must not be empty")
        for key, value, low in (
            ("--port", self.port, 0),
            ("--metrics-port", self.metrics_port, 0),
        ):
            if not low <= value <= 65535:
                raise ConfigError(f"{key} must be in [{low}, 65535], got {value}")
        if not _DEVICE.match(self.device):
            raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.runner not in _RUNNERS:
            raise ConfigError(f"--runner must be one of {', '.join(_RUNNERS)}, got {self.runner!r}")
        if self.attention_mode not in _ATTENTION_MODES:
            raise ConfigError(
                f"--attention-mode must be one of {', '.join(_ATTENTION_MODES)}, "
                f"got {self.attention_mode!r}"
            )
        if self.dtype not in _DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.quantize not in _QUANTIZE:
            raise ConfigError(
                f"--quantize must be one of {', '.join(_QUANTIZE)}, got {self.quantize!r}"
            )
        if self.quantize != "none":
            if self.dtype not in ("auto", "float32"):
                raise ConfigError(
                    f"--quantize {self.quantize} computes in float32 between its int8 products; "
                    f"--dtype {self.dtype} cannot be combined with it (use auto or float32)"
                )
            if self.device.startswith("cuda"):
                raise ConfigError(f"--quantize {self.quantize} runs on the CPU (--device cpu)")
        if self.max_batch_tokens < 0:
            raise ConfigError(
                f"--max-batch-tokens must not be negative, got {self.max_batch_tokens}"
            )
        for key, value in (
            ("--max-batch-rows", self.max_batch_rows),
            ("--max-queued-tokens", self.max_queued_tokens),
        ):
            if value < 1:
                raise ConfigError(f"{key} must be at least 1, got {value}")
        if self.max_queue_seconds < 0:
            raise ConfigError(
                f"--max-queue-seconds must not be negative, got {self.max_queue_seconds}"
            )
        if self.drain_seconds < 0:
            raise ConfigError(f"--drain-seconds must not be negative, got {self.drain_seconds}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        self._check_generation()

    def _check_generation(self) -> None:
        for key, value, low in (
            ("--max-running-seqs", self.max_running_seqs, 1),
            ("--kv-pages", self.kv_pages, 0),
            ("--kv-page-size", self.kv_page_size, 1),
            ("--spec-draft-tokens", self.spec_draft_tokens, 0),
            ("--draft-layers", self.draft_layers, 0),
        ):
            if value < low:
                raise ConfigError(f"{key} must be at least {low}, got {value}")
        if self.spec not in _SPEC_METHODS:
            raise ConfigError(
                f"--spec must be one of {', '.join(_SPEC_METHODS)}, got {self.spec!r}"
            )
        if self.spec == "draft" and bool(self.draft_model) == bool(self.draft_layers):
            raise ConfigError(
                "--spec draft needs exactly one of --draft-model (a model) or "
                "--draft-layers (the target's first N layers)"
            )
        if self.spec != "draft" and (self.draft_model or self.draft_layers):
            raise ConfigError("--draft-model / --draft-layers are only used with --spec draft")
        if self.spec == "mtp" and not self.mtp_head and self.bundled_mtp_head is None:
            raise ConfigError(
                "--spec mtp needs --mtp-head (a trained head's directory); Trellis ships "
                "heads only for " + ", ".join(h.target for h in BUNDLED.values())
            )
        if self.spec != "mtp" and self.mtp_head:
            raise ConfigError("--mtp-head is only used with --spec mtp")
        if self.spec_tree and self.spec != "mtp":
            raise ConfigError("--spec-tree is only used with --spec mtp")
        if self.spec_tree_nodes is not None and self.spec_tree_nodes < 0:
            raise ConfigError(f"--spec-tree-nodes must be at least 0, got {self.spec_tree_nodes}")
        if self.spec_tree_nodes and self.spec != "mtp":
            raise ConfigError("--spec-tree-nodes is only used with --spec mtp")
        if self.spec_tree_nodes and self.spec_tree:
            raise ConfigError("--spec-tree-nodes (a dynamic tree) excludes --spec-tree")
        if not 0.0 <= self.spec_chain_min_prob < 1.0:
            raise ConfigError(
                f"--spec-chain-min-prob must be in [0, 1), got {self.spec_chain_min_prob}"
            )
        if self.spec_chain_min_prob and self.spec != "mtp":
            raise ConfigError("--spec-chain-min-prob is only used with --spec mtp")
        if self.spec_chain_min_prob and (self.spec_tree or self.spec_tree_nodes):
            raise ConfigError("--spec-chain-min-prob is for chains, not --spec-tree(-nodes)")
        if self.spec_lookup is not None and not 0 <= self.spec_lookup <= 4:
            raise ConfigError(f"--spec-lookup must be 0 (off) or 1..4, got {self.spec_lookup}")
        if self.spec_lookup and self.spec != "mtp":
            raise ConfigError("--spec-lookup is only used with --spec mtp")
        if self.spec_lookup_drafts < 1:
            raise ConfigError(
                f"--spec-lookup-drafts must be at least 1, got {self.spec_lookup_drafts}"
            )
        if self.spec_adaptive and self.spec not in ("ngram", "draft"):
            raise ConfigError("--spec-adaptive is only used with --spec ngram or draft")
        if self.spec_ngram_per_match is not None:
            if self.spec_ngram_per_match < 0:
                raise ConfigError(
                    f"--spec-ngram-per-match must be >= 0, got {self.spec_ngram_per_match}"
                )
            if self.spec_ngram_per_match and self.spec != "ngram":
                raise ConfigError("--spec-ngram-per-match is only used with --spec ngram")
        widths = self.spec_tree_widths
        if len(widths) > self.draft_tokens:
            raise ConfigError(
                f"--spec-tree has {len(widths)} depths but --spec-draft-tokens is "
                f"{self.draft_tokens}"
            )

    @property
    def draft_tokens(self) -> int:
        """``--spec-draft-tokens``, or by method when 0: 16 for ``ngram`` sizing its drafts
        by the match (`ngram_per_match`) or adaptively (a step drafts that many only on a
        long match, or after its shorter drafts were all kept), the default tree's depth for
        ``mtp`` drafting it (`tree_nodes`), else 4."""
        if self.spec_draft_tokens:
            return self.spec_draft_tokens
        if self.spec == "ngram" and (self.ngram_per_match or self.spec_adaptive):
            return 16
        return _MTP_TREE_DEPTH if self._default_tree else 4

    @property
    def lookup_min_match(self) -> int:
        """``--spec-lookup``, or by method when not given: `_MTP_LOOKUP` for ``--spec mtp``,
        else 0."""
        if self.spec_lookup is not None:
            return self.spec_lookup
        return _MTP_LOOKUP if self.spec == "mtp" else 0

    @property
    def tree_nodes(self) -> int:
        """``--spec-tree-nodes``, or by method when not given: `_MTP_TREE_NODES` for the
        default tree of ``--spec mtp`` (`_default_tree`), else 0."""
        if self.spec_tree_nodes is not None:
            return self.spec_tree_nodes
        return _MTP_TREE_NODES if self._default_tree else 0

    @property
    def _default_tree(self) -> bool:
        """``--spec mtp`` with no flag that shapes its drafts (``--spec-tree-nodes``,
        ``--spec-tree``, ``--spec-chain-min-prob``): it drafts the default dynamic tree."""
        return (
            self.spec == "mtp"
            and self.spec_tree_nodes is None
            and not self.spec_tree
            and not self.spec_chain_min_prob
        )

    @property
    def ngram_per_match(self) -> int:
        """``--spec-ngram-per-match``; for ``--spec ngram`` 4 when not given, else 0."""
        if self.spec != "ngram":
            return 0
        return 4 if self.spec_ngram_per_match is None else self.spec_ngram_per_match

    @property
    def bundled_mtp_head(self) -> BundledHead | None:
        """The MTP head Trellis ships for ``--model`` (None: none ships for it)."""
        return bundled_head_for(self.model)

    @property
    def spec_tree_widths(self) -> tuple[int, ...]:
        """``--spec-tree`` as a tuple of widths (``()`` when empty)."""
        if not self.spec_tree.strip():
            return ()
        try:
            widths = tuple(int(w) for w in self.spec_tree.split(","))
        except ValueError:
            widths = ()
        if not widths or min(widths) < 1:
            raise ConfigError(
                f"--spec-tree must be comma-separated widths >= 1 (e.g. 3,2), "
                f"got {self.spec_tree!r}"
            )
        return widths

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> TulipConfig:
        """Build from command-line flags, falling back to ``TULIP_*`` environment variables."""
        env = dict(environ or {})
        parser = _parser()
        args = parser.parse_args(list(argv or []))
        values: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            given = getattr(args, field.name)
            if given is None and env_name(flag) in env:
                given = _parse_env(flag, field.name, env[env_name(flag)])
            if given is not None:
                values[field.name] = given
        if "model" not in values:
            raise ConfigError("--model is required (or set TULIP_MODEL)")
        return cls(**values)  # type: ignore[arg-type]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tulip",
        description="Tulip: gRPC inference server for one model "
        "(every flag can also be set as TULIP_<FLAG>, e.g. TULIP_MAX_BATCH_TOKENS).",
    )
    add = parser.add_argument
    add("--model", help="model directory, asset name (rose.assets) or Hub id owner/name[@rev]")
    add("--model-name", help="served model name (default: the directory's basename)")
    add("--host", help="listen address (default 127.0.0.1; containers: 0.0.0.0)")
    add("--port", type=int, help="gRPC port (default 50051)")
    add("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    add("--dtype", help="auto | float32 | bfloat16 | float16 (default auto)")
    add(
        "--quantize",
        help="none | int8: CPU encoders on int8 weights, gated by accuracy at load (default none)",
    )
    add(
        "--max-batch-tokens",
        type=int,
        help="token budget of one batch (generators: of one step, prompts prefilled in chunks "
        "of it), 0: by device (default: 16384 on GPU, 2048 on CPU; generators 2048 / 512)",
    )
    add("--max-batch-rows", type=int, help="row cap of one batch (default 256)")
    add("--max-queued-tokens", type=int, help="admission limit on queued tokens (default 262144)")
    add(
        "--max-queue-seconds",
        type=float,
        help="refuse work that would wait longer than this for the engine, 0: no bound (default 1)",
    )
    add(
        "--runner",
        help="auto (by the model directory) | generate (chat, completions) | pooling "
        "(embeddings, scores)",
    )
    add(
        "--attention-mode",
        help="encoders: auto (as the model directory says) | causal | bidirectional",
    )
    add("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None, help="CUDA graphs")
    add("--metrics-port", type=int, help="Prometheus port, 0 disables (default 9100)")
    add("--drain-seconds", type=float, help="grace period on SIGTERM (default 30)")
    add("--threads", type=int, help="torch intra-op threads (default: all cores)")
    gen = parser.add_argument_group("generation (decoder models)")
    gen.add_argument("--max-running-seqs", type=int, help="sequences decoded together (default 32)")
    gen.add_argument(
        "--kv-pages", type=int, help="KV cache pages, 0 = two full contexts (default 0)"
    )
    gen.add_argument("--kv-page-size", type=int, help="tokens per KV page (default 16)")
    gen.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV pages of repeated prompt prefixes (default on)",
    )
    gen.add_argument("--spec", help="speculative decoding: none | ngram | draft | mtp")
    gen.add_argument(
        "--spec-draft-tokens",
        type=int,
        help="tokens drafted per step, the most when sized by the match or adaptively "
        "(default 16 for ngram, 3 for mtp's default tree, else 4)",
    )
    gen.add_argument(
        "--spec-adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="grow drafts after fully kept steps, shrink after rejections (default off)",
    )
    gen.add_argument(
        "--spec-ngram-per-match",
        type=int,
        help="--spec ngram: draft at most N tokens per matched suffix token, 0: always "
        "--spec-draft-tokens (default 4)",
    )
    gen.add_argument(
        "--spec-tree", help="--spec mtp: draft-tree widths per depth, e.g. 3,2 (default: chain)"
    )
    gen.add_argument(
        "--spec-tree-nodes",
        type=int,
        help="--spec mtp: dynamic draft tree of N nodes, 0: chains (default 3, unless "
        "--spec-tree or --spec-chain-min-prob)",
    )
    gen.add_argument(
        "--spec-chain-min-prob",
        type=float,
        help="--spec mtp: stop a chain below this head probability (default 0: fixed length)",
    )
    gen.add_argument(
        "--spec-lookup",
        type=int,
        help="--spec mtp: copy from the context instead of drafting where it ends in a "
        f"repeat of N+ tokens, 0: off (default {_MTP_LOOKUP})",
    )
    gen.add_argument(
        "--spec-lookup-drafts",
        type=int,
        help="--spec mtp with --spec-lookup: tokens a copy drafts at most (default 5)",
    )
    gen.add_argument("--draft-model", help="--spec draft: drafter directory, asset name or Hub id")
    gen.add_argument(
        "--draft-layers", type=int, help="--spec draft: use the target's first N layers"
    )
    gen.add_argument("--mtp-head", help="--spec mtp: trained MTP head directory")
    return parser


def _parse_env(flag: str, name: str, raw: str) -> object:
    field_type = {f.name: f.type for f in dataclasses.fields(TulipConfig)}[name]
    text = raw.strip()
    key = f"{env_name(flag)} ({flag})"
    if field_type in ("bool", "bool | None"):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{key} must be a boolean (true/false/1/0), got {raw!r}")
    if field_type in ("int", "int | None"):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {raw!r}") from None
    if field_type == "float":
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {raw!r}") from None
    return text
