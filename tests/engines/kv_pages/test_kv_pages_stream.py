"""`PageStream`'s engine-specific aux messages go out in send order, and the name `meta`
stays reserved for `send_meta`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from prfaas.engines.kv_pages import META, PageStream, decode_meta
from prfaas.engines.transport import Kind


class ListSink:
    """A `LayerSink` keeping every message in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, object]] = []

    def send_layer(
        self,
        layer: int,
        kind: Kind,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        self.messages.append(("layer", (layer, kind, blocks)))

    def send_aux(self, name: str, payload: bytes) -> None:
        self.messages.append((name, payload))

    def finish(self) -> None:
        self.messages.append(("end", None))

    def abort(self, reason: str) -> None:
        self.messages.append(("abort", reason))


def test_aux_messages_keep_their_order_and_meta_is_reserved() -> None:
    sink = ListSink()
    stream = PageStream(sink)
    stream.send_arrays(3, Kind.FULL_KV, {"k": np.zeros((1, 4, 2))}, blocks=(0, 1))
    stream.send_aux("engine_buffers", b"\x01\x02")
    stream.send_meta({"num_tokens": 4})
    stream.finish()
    assert [name for name, _ in sink.messages] == ["layer", "engine_buffers", META, "end"]
    assert sink.messages[1][1] == b"\x01\x02"
    assert decode_meta(sink.messages[2][1]) == {"num_tokens": 4}  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserved"):
        stream.send_aux(META, b"{}")
