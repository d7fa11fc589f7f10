"""The global KV index: which instance caches which prefix blocks (`manager`), in numpy
hash tables (`table`) whose block rows name their holders by interned set (`holder_sets`)."""

from __future__ import annotations

from prfaas.gateway.kv_index.manager import FLUSH_BLOCKS, KVIndexManager

__all__ = ["FLUSH_BLOCKS", "KVIndexManager"]
