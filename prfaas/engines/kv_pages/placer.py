"""Decode side: `PagePlacer` writes one request's received messages into the destination
pool's own pages and state slot, and checks at the end that nothing is missing."""

from __future__ import annotations

from collections.abc import Sequence

from prfaas.engines.kv_pages.errors import PageError
from prfaas.engines.kv_pages.pool import PagedPool
from prfaas.engines.kv_pages.wire import model_layer
from prfaas.engines.transport import Kind, LayerItem


class PagePlacer:
    """Places one request's `LayerItem`s (in the order received) into `pool`.

    `block_ids` is the request's block table in this pool (its logical page i is physical
    page `block_ids[i]`); `slot` is the state slot its linear layers go to (None when the
    pool has no state layers).
    """

    def __init__(self, pool: PagedPool, block_ids: Sequence[int], slot: int | None) -> None:
        self.pool = pool
        self.block_ids = tuple(block_ids)
        self.slot = slot
        self._tokens: dict[int, int] = {}  # layer -> tokens placed contiguously from 0
        self._states: set[int] = set()

    def place(self, item: LayerItem) -> None:
        """Write one received message into the pool.

        Raises:
            PageError: a kind this pool cannot hold, a gap in a layer's pages, or arrays
                that do not fit (see `PagedPool.scatter` / `write_state`).
        """
        layer = model_layer(item.layer)
        if item.kind is Kind.FULL_KV:
            self._place_pages(layer, item)
        elif item.kind is Kind.LINEAR_STATE:
            if self.slot is None:
                raise PageError(f"layer {layer}: a state arrived but the request has no slot")
            self.pool.write_state(layer, self.slot, item.arrays)
            self._states.add(layer)
        else:
            raise PageError(f"layer {layer}: cannot place a {item.kind.name} message")

    def _place_pages(self, layer: int, item: LayerItem) -> None:
        blocks = item.arrays.blocks
        if blocks is None or not item.arrays:
            raise PageError(f"layer {layer}: FULL_KV without a block range or arrays")
        first = next(iter(item.arrays.values()))
        sender_page = int(first.shape[1]) if first.ndim > 1 else 0
        if first.shape[0] != blocks[1] - blocks[0] or sender_page == 0:
            raise PageError(f"layer {layer}: {first.shape[0]} pages for block range {blocks}")
        start = blocks[0] * sender_page
        if start > self._tokens.get(layer, 0):
            raise PageError(f"layer {layer}: pages from token {start} arrived before earlier ones")
        written = self.pool.scatter(layer, item.arrays, start, self.block_ids)
        self._tokens[layer] = max(self._tokens.get(layer, 0), start + written)

    def tokens(self, layer: int) -> int:
        """Tokens of `layer` placed so far (contiguous from the first)."""
        return self._tokens.get(layer, 0)

    def check_complete(self, num_tokens: int) -> None:
        """Raise PageError unless every paged layer holds `num_tokens` tokens and every state
        layer its state (call it once the transfer ended)."""
        for layer in self.pool.pages:
            if self.tokens(layer) < num_tokens:
                raise PageError(
                    f"layer {layer}: {self.tokens(layer)} tokens arrived, {num_tokens} expected"
                )
        missing = sorted(set(self.pool.states) - self._states)
        if self.slot is not None and missing:
            raise PageError(f"linear layers {missing}: no state arrived")
