"""Checkpoint tensors → a module tree's state dict through an explicit name map.

A family describes its weights as `Spec`: our parameter name → (checkpoint names, concatenated
along dim 0; the parameter's shape). `take` checks the checkpoint holds exactly those names
(plus the ones the family says it may ignore), with those shapes, and returns the state dict.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from rose.errors import EngineError

__all__ = ["Spec", "find_prefix", "take"]

Spec = dict[str, tuple[tuple[str, ...], tuple[int, ...]]]


def find_prefix(tensors: Mapping[str, torch.Tensor], anchor: str, prefixes: tuple[str, ...]) -> str:
    """The one prefix p of `prefixes` for which p + anchor is in the checkpoint."""
    found = [p for p in prefixes if p + anchor in tensors]
    if len(found) != 1:
        raise EngineError(
            f"weights: expected exactly one of {[p + anchor for p in prefixes]}, found {len(found)}"
        )
    return found[0]


def take(
    spec: Spec,
    tensors: Mapping[str, torch.Tensor],
    ignorable: Collection[str] = (),
    ignored_prefixes: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """The state dict `spec` describes; EngineError on any missing, unexpected (neither
    `ignorable` nor under `ignored_prefixes`) or misshapen tensor."""
    used = {s for srcs, _ in spec.values() for s in srcs}
    missing = sorted(s for s in used if s not in tensors)
    if missing:
        raise EngineError(f"weights: missing {len(missing)} tensors, e.g. {missing[:5]}")
    unexpected = sorted(
        k
        for k in tensors
        if k not in used and k not in ignorable and not k.startswith(ignored_prefixes)
    )
    if unexpected:
        raise EngineError(f"weights: {len(unexpected)} unexpected tensors, e.g. {unexpected[:5]}")
    state: dict[str, torch.Tensor] = {}
    for dst, (srcs, shape) in spec.items():
        parts = [tensors[s] for s in srcs]
        part_shape = (shape[0] // len(parts), *shape[1:])
        if len(parts) > 1 and any(tuple(p.shape) != part_shape for p in parts):
            raise EngineError(f"weights: {', '.join(srcs)} do not each have shape {part_shape}")
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(value.shape) != shape:
            raise EngineError(
                f"weights: {'+'.join(srcs)} has shape {tuple(value.shape)}, expected {shape}"
            )
        state[dst] = value
    return state
