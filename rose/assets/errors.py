"""The one error type of the asset pipeline."""

from __future__ import annotations

__all__ = ["AssetError"]


class AssetError(Exception):
    """A model asset could not be pulled, converted or verified.

    The message names the asset (and the package or file involved) and is meant to be
    shown to a user as is: the CLI prints it and exits 1, without a traceback.
    """
