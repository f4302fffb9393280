"""Speculation metrics, accumulated by the engine and returned (never printed)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SpecStats"]


@dataclass
class SpecStats:
    """Counters over verification steps that carried drafts.

    steps: verify steps with at least one draft. drafted / accepted: draft tokens proposed
    / kept. proposed_at[i] / accepted_at[i]: steps whose draft had a position i / kept it.
    emitted: tokens produced by those steps (accepted + the one resampled/bonus token).
    alternatives: steps whose kept drafts end in a draft tree's alternative (a leaf beside
    the chain; `rose.spec.tree`); their accepted count is the kept path's depth.
    draft_s / verify_s: wall seconds spent drafting / in target verification passes.
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    alternatives: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record(self, num_drafted: int, num_accepted: int, alternative: bool = False) -> None:
        self.steps += 1
        self.alternatives += int(alternative)
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.emitted += num_accepted + 1
        while len(self.proposed_at) < num_drafted:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_drafted):
            self.proposed_at[i] += 1
            self.accepted_at[i] += int(i < num_accepted)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens kept."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafts kept per verification step (tokens per step is this + 1)."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft position i kept), over steps that proposed position i."""
        return [
            a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at, strict=True)
        ]

    def as_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "alternatives": self.alternatives,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": self.acceptance_per_position,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
        }
