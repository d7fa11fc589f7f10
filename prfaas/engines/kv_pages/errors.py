"""Errors of the page/state mover."""

from __future__ import annotations


class PageError(ValueError):
    """Received pages or states do not fit the destination pool (layer, component, shape,
    dtype, a gap in a layer's pages), or a transfer ended incomplete. The message says which."""
