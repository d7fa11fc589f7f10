"""Decode side: `PagePlacer` writes one request's received messages into the destination
pool's own pages and state slot, and checks at the end that nothing is missing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prfaas.engines.kv_pages.errors import PageError
from prfaas.engines.kv_pages.pool import PagePool
from prfaas.engines.kv_pages.wire import model_layer
from prfaas.engines.transport import Kind, LayerItem


class PagePlacer:
    """Places one request's `LayerItem`s (in the order received) into `pool`.

    `block_ids[layer]` is the request's block table for a paged layer (its logical page i
    is physical page `block_ids[layer][i]`; engines with one table for every layer pass the
    same one); `slots[layer]` is the state slot a linear layer's state goes to. Tokens below
    `skip_tokens` are already held here (a local prefix-cache hit) and are not overwritten.
    """

    def __init__(
        self,
        pool: PagePool,
        block_ids: Mapping[int, Sequence[int]],
        slots: Mapping[int, int],
        *,
        skip_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.block_ids = {layer: tuple(ids) for layer, ids in block_ids.items()}
        self.slots = dict(slots)
        self.skip_tokens = skip_tokens
        self._tokens: dict[int, int] = {}  # layer -> tokens held contiguously from 0
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
            slot = self.slots.get(layer)
            if slot is None:
                raise PageError(f"layer {layer}: a state arrived but the request has no slot")
            self.pool.write_state(layer, slot, item.arrays)
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
        if start > self.tokens(layer):
            raise PageError(f"layer {layer}: pages from token {start} arrived before earlier ones")
        table = self.block_ids.get(layer)
        if table is None:
            raise PageError(f"layer {layer}: pages arrived but the request has no block table")
        end = self.pool.scatter(layer, item.arrays, start, table, skip=self.skip_tokens)
        self._tokens[layer] = max(self.tokens(layer), end)

    def tokens(self, layer: int) -> int:
        """Tokens of `layer` held so far, contiguous from the first (skipped ones included)."""
        return self._tokens.get(layer, self.skip_tokens)

    def check_complete(self, num_tokens: int) -> None:
        """Raise PageError unless every paged layer holds `num_tokens` tokens and every state
        layer its state (call it once the transfer ended)."""
        for layer in self.pool.page_layers:
            if self.tokens(layer) < num_tokens:
                raise PageError(
                    f"layer {layer}: {self.tokens(layer)} tokens arrived, {num_tokens} expected"
                )
        missing = sorted(set(self.slots) - self._states)
        if missing:
            raise PageError(f"linear layers {missing}: no state arrived")
