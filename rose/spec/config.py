"""Speculation settings for one deployment."""

from __future__ import annotations

from dataclasses import dataclass

from rose.spec.proposer import proposer_methods

__all__ = ["SpecConfig"]

_DRAFT_DTYPES = ("auto", "float32", "bfloat16", "int4")
_DEVICE_CHAIN = ("auto", "on", "off")


@dataclass(frozen=True)
class SpecConfig:
    """method: "none", "ngram" (prompt lookup), "draft" (a drafter model), "mtp" (a draft
    head on the target's features, `rose.spec.mtp`) or a proposer registered with
    `rose.spec.proposer.register_proposer`.
    num_draft_tokens: k, tokens proposed per step.
    ngram_max / ngram_min: longest / shortest suffix n-gram looked up (prompt lookup).
    ngram_draft_per_match: ngram only: a lookup whose matched suffix is n tokens long drafts
        at most n times this many (within num_draft_tokens), so copies found on long
        matches run long and guesses from one matching token stay short
        (`rose.spec.ngram`); 0: num_draft_tokens whatever matched.
    adaptive_k: per sequence, draft 2 more tokens (up to num_draft_tokens) after a step
    that kept every draft and 1 fewer (down to 1) after a rejection.
    draft_dtype: precision the MTP head drafts in. Drafts only need to be good guesses
    (the target verifies in its own precision and the proposal distribution is whatever the
    head computed), so "auto" runs the head's products in bfloat16 where the hardware has
    fast bf16 matrix products (CUDA, or oneDNN's AVX512-BF16/AMX path on the CPU), which
    halves the weight bytes each draft step reads, and on top of that with int4 weights on
    a CPU where PyTorch has the int4 kernel (`rose.quant`; a quarter of bf16's bytes: 0.4
    vs 1.05 ms per head step, as many drafts accepted); elsewhere in the head's own dtype.
    "int4": int4 weights, bf16 activations (an error where the kernel is missing).
    tree_widths: MTP only. Tokens verified at each draft depth: ``tree_widths[d]`` is the
    chain's token plus the head's next best ``tree_widths[d] - 1`` at depth ``d + 1``, as
    leaves of a draft tree (`rose.spec.tree`); depths past the tuple have width 1, and ()
    is the plain chain. Greedy requests only (sampled ones draft the chain).
    tree_nodes: MTP only, instead of tree_widths: a dynamic draft tree of this many nodes,
    chosen per step by the head's own path probabilities (up to num_draft_tokens deep);
    0: off. Greedy requests only.
    chain_min_prob: MTP chains of greedy requests, without a tree: a sequence's chain stops
        growing once the head's own probability that all of it is right (the product of
        its drafts' probabilities) falls below this, so num_draft_tokens becomes the
        longest chain: confident chains go deeper, unlikely ones stop before the head
        steps and verified rows they would waste (the draft that fell below is kept). 0:
        every chain is num_draft_tokens long. The host path decides after each head step
        and skips the rest; a device chain (device_chain) runs all num_draft_tokens head
        steps with fixed shapes and drops the drafts past the stop before they are
        verified, so it saves verified rows there but not head steps.
        `python -m bench chain_stop` measures it per head: 0.15 with k = 5 for the
        SmolLM2-135M head on one CPU thread with bf16 drafts (1.83x against 1.76x for a
        fixed k = 3 on its tuning prompts, with 0.1-0.35 all within 2% of it).
    lookup_min_match: MTP only: a step whose context ends in this many tokens (or more, up
        to ngram_max) that occurred earlier copies what followed them (prompt lookup,
        `rose.spec.ngram`) instead of asking the head, ``lookup_drafts`` tokens at most; the
        head's cache catches up on the kept tokens' features at its next step. A long match
        is the better guess: copied text (a quoted name, a repeated phrase, code) runs on for
        several tokens, where the head keeps about one draft per step. 0: off.
    lookup_drafts: tokens a lookup step copies at most (lookup_min_match).
    device_chain: MTP chains when every running request is greedy: "on" accepts on the
    device and drafts the next chain in the same step, reading the outcome back once after
    it (`rose.spec.mtp.MTPDrafter.chain_after_verify`), so that on a GPU no host
    synchronization sits between a verification and the next draft; "off" accepts on the
    host, then drafts at the start of the next step (the general path); "auto": "on" off
    the CPU. On the CPU nothing runs asynchronously, and the fixed shapes cost a little:
    step 0 feeds every verified row (k + 1) instead of the accepted ones (6.9 vs 6.3 ms of
    drafting per step at k = 3 on SmolLM2-135M, one thread).
    """

    method: str = "none"
    num_draft_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    ngram_draft_per_match: int = 0
    adaptive_k: bool = False
    draft_dtype: str = "auto"
    tree_widths: tuple[int, ...] = ()
    tree_nodes: int = 0
    chain_min_prob: float = 0.0
    lookup_min_match: int = 0
    lookup_drafts: int = 5
    device_chain: str = "auto"

    def next_draft_len(self, drafted: int, kept: int) -> int:
        """``adaptive_k``: drafts a sequence wants next after a step that kept ``kept`` of
        its ``drafted``: 2 more after keeping all (up to num_draft_tokens), else 1 fewer
        (down to 1)."""
        if kept == drafted:
            return min(self.num_draft_tokens, drafted + 2)
        return max(1, drafted - 1)

    @property
    def max_drafts(self) -> int:
        """Most drafts one step proposes per sequence: the chain's num_draft_tokens, or a
        lookup's lookup_drafts when longer (lookup_min_match)."""
        if self.lookup_min_match:
            return max(self.num_draft_tokens, self.lookup_drafts)
        return self.num_draft_tokens

    @property
    def max_fed_drafts(self) -> int:
        """Most draft tokens one verification pass feeds per sequence (tree nodes included)."""
        if self.tree_nodes:
            most = max(self.num_draft_tokens, self.tree_nodes)
        else:
            most = self.num_draft_tokens + sum(w - 1 for w in self.tree_widths)
        return max(most, self.max_drafts)

    def __post_init__(self) -> None:
        methods = proposer_methods()
        if self.method not in methods:
            raise ValueError(f"spec.method must be one of {methods}, got {self.method!r}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"spec.num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.device_chain not in _DEVICE_CHAIN:
            raise ValueError(
                f"spec.device_chain must be one of {_DEVICE_CHAIN}, got {self.device_chain!r}"
            )
        prob = self.chain_min_prob
        if isinstance(prob, bool) or not isinstance(prob, int | float) or not 0.0 <= prob < 1.0:
            raise ValueError(f"spec.chain_min_prob must be a number in [0, 1), got {prob!r}")
        if prob and self.method != "mtp":
            raise ValueError(
                f"spec.chain_min_prob is for method 'mtp' (a draft head's probabilities), "
                f"got method {self.method!r}"
            )
        if prob and (self.tree_widths or self.tree_nodes):
            raise ValueError("spec.chain_min_prob is for chains; a draft tree sizes itself")
        if self.draft_dtype not in _DRAFT_DTYPES:
            raise ValueError(
                f"spec.draft_dtype must be one of {_DRAFT_DTYPES}, got {self.draft_dtype!r}"
            )
        widths = self.tree_widths
        if not isinstance(widths, tuple) or not all(
            isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths
        ):
            raise ValueError(f"spec.tree_widths must be a tuple of ints >= 1, got {widths!r}")
        if widths and self.method != "mtp":
            raise ValueError(
                f"spec.tree_widths is for method 'mtp' (a draft head's ranked tokens), "
                f"got method {self.method!r}"
            )
        if isinstance(self.tree_nodes, bool) or not isinstance(self.tree_nodes, int):
            raise ValueError(f"spec.tree_nodes must be an int, got {self.tree_nodes!r}")
        for name in ("lookup_min_match", "lookup_drafts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"spec.{name} must be an int >= 0, got {value!r}")
        if self.lookup_min_match and self.method != "mtp":
            raise ValueError(
                f"spec.lookup_min_match is for method 'mtp' (lookup in place of the head), "
                f"got method {self.method!r}"
            )
        if self.lookup_min_match and not self.ngram_min <= self.lookup_min_match <= self.ngram_max:
            raise ValueError(
                f"spec.lookup_min_match must be within ngram_min..ngram_max "
                f"({self.ngram_min}..{self.ngram_max}), got {self.lookup_min_match}"
            )
        if self.lookup_min_match and self.lookup_drafts < 1:
            raise ValueError("spec.lookup_drafts must be >= 1 with spec.lookup_min_match")
        if self.tree_nodes < 0:
            raise ValueError(f"spec.tree_nodes must be >= 0, got {self.tree_nodes}")
        if self.tree_nodes and self.method != "mtp":
            raise ValueError(
                f"spec.tree_nodes is for method 'mtp' (a draft head's ranked tokens), "
                f"got method {self.method!r}"
            )
        if self.tree_nodes and widths:
            raise ValueError("spec.tree_nodes (a dynamic tree) excludes spec.tree_widths")
        if len(widths) > self.num_draft_tokens:
            raise ValueError(
                f"spec.tree_widths has {len(widths)} depths but num_draft_tokens is "
                f"{self.num_draft_tokens}"
            )
        per_match = self.ngram_draft_per_match
        if isinstance(per_match, bool) or not isinstance(per_match, int) or per_match < 0:
            raise ValueError(f"spec.ngram_draft_per_match must be an int >= 0, got {per_match!r}")
        if per_match and self.method != "ngram":
            raise ValueError(
                f"spec.ngram_draft_per_match is for method 'ngram', got method {self.method!r}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"spec.ngram_min/ngram_max must satisfy 1 <= min <= max, "
                f"got {self.ngram_min}/{self.ngram_max}"
            )
