"""How pages and states map onto transport messages (the conventions both sides share).

- A full-attention layer's pages travel as `Kind.FULL_KV`, one array per component,
  `(n, page_size, *token_shape)` in the sender's page size, with `blocks = (b0, b0 + n)`:
  the request's *logical* page indices (position in its block table), never physical ids,
  so the receiver places them in its own pages, whatever their ids or its page size.
- A linear-attention layer's state travels once as `Kind.LINEAR_STATE`, one array per
  state component, `state_shape` (the slot axis dropped).
- The transport carries each layer number once per room; a layer sent in several pieces
  (chunked prefill) goes out as wire layer `part * LAYER_PART_STRIDE + layer`.
- Metadata (first token, lengths, engine-specific fields) is the JSON aux message `meta`,
  sent last.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

LAYER_PART_STRIDE = 1 << 16
META = "meta"


def wire_layer(layer: int, part: int) -> int:
    """The transport layer number of piece `part` of model layer `layer`."""
    if not 0 <= layer < LAYER_PART_STRIDE:
        raise ValueError(f"layer must be in 0..{LAYER_PART_STRIDE - 1}, got {layer}")
    return part * LAYER_PART_STRIDE + layer


def model_layer(wire: int) -> int:
    """The model layer a transport layer number belongs to."""
    return wire % LAYER_PART_STRIDE


def encode_meta(meta: Mapping[str, Any]) -> bytes:
    """The `meta` aux payload."""
    return orjson.dumps(dict(meta))


def decode_meta(payload: bytes | None) -> dict[str, Any]:
    """The `meta` aux payload as a dict; ValueError if missing or not a JSON object."""
    if payload is None:
        raise ValueError("the transfer carried no meta")
    meta = orjson.loads(payload)
    if not isinstance(meta, dict):
        raise ValueError("meta is not a JSON object")
    return meta
