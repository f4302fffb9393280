"""Token sampling: parameters, logits → filtered distribution, draws, and stop rules.

Every sampling mode is expressed as a probability distribution (greedy = one-hot of the
argmax), so speculative acceptance (`rose.spec.acceptance`) works on the same
distributions the non-speculative path samples from.

Example::

    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=64)
    gen = params.generator()
    probs = token_probs(logits, params)          # [N, V]
    ids = sample(probs, params, gen)             # [N]
    token_logprobs(logits, ids.tolist(), top=5)  # what the OpenAI API calls logprobs
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from rose.grammar import JsonFormat

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_LOGIT_BIAS",
    "MAX_PENALTY",
    "MAX_TOP_LOGPROBS",
    "FinishReason",
    "SamplingParams",
    "StopChecker",
    "TokenLogprob",
    "adjust_logits",
    "sample",
    "token_logprobs",
    "token_probs",
]

FinishReason = str  # "stop" (EOS / stop string / stop token) or "length" (max_tokens)

MAX_TOP_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2], as OpenAI's
MAX_LOGIT_BIAS = 100.0  # a logit_bias entry lies in [-100, 100], as OpenAI's
GREEDY_TEMPERATURE = 1e-5  # temperatures below it sample greedily (`SamplingParams.greedy`)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature: below `GREEDY_TEMPERATURE` (0 included) greedy (argmax); otherwise logits
    are divided by it. (Dividing fp32 logits by a smaller one overflows to inf and NaN, and
    its distribution is one-hot at the argmax to fp32 precision anyway: vLLM draws the same
    line.)
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass (1.0 = off).
    seed: seeds this request's own generator (None = nondeterministic).
    max_tokens: most tokens generated. stop: strings that end generation (the text is cut
    before them). stop_token_ids: extra ids that end generation like EOS. ignore_eos:
    keep generating past the model's EOS ids. response_format: hold the output to a JSON
    format (`rose.grammar`; None: free text); it ends at the grammar's end (an EOS id).
    logprobs: report each generated token's log probability with this many most likely
    alternatives (0..MAX_TOP_LOGPROBS; `token_logprobs`); None: none are computed.
    prompt_logprobs: the same for every prompt token after the first (vLLM's
    ``prompt_logprobs``, what completions' ``echo`` with ``logprobs`` reports): the log
    probability the model gives it after the tokens before it, with this many alternatives;
    None: none are computed.
    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]: a token's logit is lowered
    by ``frequency_penalty * c + presence_penalty * (c > 0)``, c its count among the tokens
    generated so far. logit_bias: (token id, bias in [-100, 100]) pairs added to those
    tokens' logits (OpenAI's). repetition_penalty: vLLM's and transformers' (> 0, 1 off):
    a token seen in the prompt or the output so far has a positive logit divided by it and
    a negative one multiplied. min_tokens: the stop ids (EOS unless ignore_eos, and
    stop_token_ids) are masked, and stop strings not looked for, until this many tokens
    are out (vLLM's). All of these apply before temperature, top-k and top-p
    (`adjust_logits`), in vLLM's order: bias and min_tokens, repetition, then presence and
    frequency. min_p: after temperature, keep the tokens whose probability is at least
    min_p times the likeliest one's (vLLM's, 0 off), before top-k and top-p.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    response_format: JsonFormat | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("sampling.stop must not contain empty strings")
        if self.response_format is not None and self.ignore_eos:
            raise ValueError("sampling.ignore_eos cannot be used with a response_format")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(
                    f"sampling.{name} must be in 0..{MAX_TOP_LOGPROBS} or None, got {value}"
                )

        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:  # NaN fails too
                raise ValueError(
                    f"sampling.{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], "
                    f"got {getattr(self, name)}"
                )

        if not (0.0 < self.repetition_penalty < float("inf")):  # NaN fails too
            raise ValueError(
                f"sampling.repetition_penalty must be a finite number > 0, got "
                f"{self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling.min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"sampling.min_tokens must be in 0..max_tokens ({self.max_tokens}), got "
                f"{self.min_tokens}"
            )
        if self.min_tokens and self.response_format is not None:
            raise ValueError("sampling.min_tokens cannot be used with a response_format")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"sampling.logit_bias: token {token} with bias {bias} (ids >= 0, biases "
                    f"in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}])"
                )

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust_logits` changes anything for this request."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.repetition_penalty != 1.0
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def adjust_logits(
    logits: torch.Tensor,
    generated: Sequence[int],
    drafts: Sequence[int],
    params: SamplingParams,
    *,
    prompt: Sequence[int] = (),
    stop_ids: Collection[int] = (),
) -> None:
    """Apply the request's logit bias, min_tokens and penalties, in place, to the logits
    ``[n, V]`` of its ``n = len(drafts) + 1`` verified rows: row j follows the tokens
    `generated` so far and ``drafts[:j]``, so each row is adjusted as plain decoding would
    adjust that position. ``prompt``: the request's prompt ids (repetition_penalty counts
    them); ``stop_ids``: the ids min_tokens holds back (`StopChecker.stop_ids`)."""
    n, vocab = logits.shape
    device = logits.device
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
        bias = torch.tensor([b for _, b in params.logit_bias], device=device)
        logits[:, ids] += bias.to(logits.dtype)
    early = min(n, params.min_tokens - len(generated))  # rows before min_tokens
    if early > 0 and stop_ids:
        logits[:early, torch.tensor(sorted(stop_ids), device=device)] = float("-inf")
    if not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1):
        return
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    if generated:
        seen = torch.tensor(generated, dtype=torch.int64, device=device)
        counts += torch.bincount(seen, minlength=vocab)[:vocab].float()
    if n > 1:  # row j also counts drafts 0..j-1
        d = torch.tensor(drafts[: n - 1], dtype=torch.int64, device=device)
        steps = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        steps[torch.arange(1, n, device=device), d] = 1.0
        counts += steps.cumsum(0)
    if params.repetition_penalty != 1:
        seen = counts > 0
        if prompt:
            seen[:, torch.tensor(prompt, dtype=torch.int64, device=device)] = True
        rp = params.repetition_penalty
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits))
    if not (params.presence_penalty or params.frequency_penalty):
        return
    penalty = counts * params.frequency_penalty + (counts > 0).float() * params.presence_penalty
    logits.sub_(penalty.to(logits.dtype))


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits ``[N, V]`` → the distribution ``[N, V]`` (fp32) this request samples from:
    greedy → one-hot argmax; else softmax(logits / T) restricted to top-k ∩ top-p."""
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(
            probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf")
        )
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the most
        # likely token always stays.
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(
    probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Draw one token per row of ``probs [N, V]`` → ``[N]`` int64."""
    if params.greedy:
        return probs.argmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability, and the most likely tokens at its position
    (most likely first; tokens the grammar forbids are left out)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def token_logprobs(logits: torch.Tensor, chosen: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits ``[M, V]``: the target's rows that produced the tokens ``chosen`` (``M``
    ids) → each token's log probability and the ``top`` most likely tokens of its row.

    The distribution is ``log_softmax`` of the raw logits in fp32 (vLLM's default "raw
    logprobs"): temperature, top-k and top-p, which shape only how a token is drawn, are
    not applied, so the numbers are the model's own whatever the sampling settings. The one
    exception is a constrained request's grammar mask (`rose.grammar`), applied to the rows
    before they get here: the masked distribution is the one its tokens come from, and
    forbidden tokens (-inf) are left out of the alternatives. One read back for all rows.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    ids = torch.tensor(list(chosen), dtype=torch.int64, device=lp.device)  # [M]
    picked = lp.gather(-1, ids[:, None])  # [M, 1]
    k = min(top, lp.shape[-1])
    values, indices = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0])  # [M, k] each
    # fp64 holds fp32 values and vocabulary ids exactly: one tensor, one read back
    rows = torch.cat([picked.double(), values.double(), indices.double()], dim=-1).tolist()
    out = []
    for row in rows:
        alts = [(int(i), v) for v, i in zip(row[1 : 1 + k], row[1 + k :], strict=True)]
        alts = [(i, v) for i, v in alts if v != float("-inf")]
        out.append(TokenLogprob(row[0], tuple(i for i, _ in alts), tuple(v for _, v in alts)))
    return out


class StopChecker:
    """Decides after each generated token whether a sequence is finished.

    EOS / stop token ids finish with "stop" and are not emitted; a stop string finishes with
    "stop" after the token that completes it, and `text` is cut before the stop string;
    reaching ``max_tokens`` finishes with "length".
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_ids: Sequence[int],
        detokenize: Callable[[list[int]], str] | None,
    ) -> None:
        if params.stop and detokenize is None:
            raise ValueError("sampling.stop needs a detokenizer")
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_ids)
        )
        self.detokenize = detokenize
        self.text: str | None = None  # set when a stop string ended the sequence
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self._searched = 0  # chars of the decoded text already searched for stop strings

    def is_stop_token(self, token: int) -> bool:
        return token in self.stop_ids

    def check(self, output_ids: list[int]) -> FinishReason | None:
        """Call after appending a (non-stop-id) token to ``output_ids``. Stop strings are
        looked for once more than ``min_tokens`` tokens are out, in the text from where it
        stood then (vLLM's rule: one that ended earlier does not count)."""
        if self.params.stop and self.detokenize is not None:
            text = self.detokenize(output_ids)
            if len(output_ids) <= self.params.min_tokens:
                self._searched = max(0, len(text) - 1)
                return None
            start = max(0, self._searched - self._longest_stop + 1)
            hits = [i for s in self.params.stop if (i := text.find(s, start)) >= 0]
            if hits:
                self.text = text[: min(hits)]
                return "stop"
            # a trailing partial character may still change; re-search the tail next time
            self._searched = max(0, len(text) - 1)
        if len(output_ids) >= self.params.max_tokens:
            return "length"
        return None
