"""`DeviceCopier`: copies between one torch device's memory and host memory that keep the
forward pass running, shared by `TorchPagePool` (paged engines) and the reference engine
(whose KV lives in per-request tensors).

On a GPU, a copy out (`to_host`) records an event on the caller's current stream (the
forward pass, which has only enqueued the tensor's last write when a layer hook runs) and
copies on a low-priority side stream into pinned host memory from a `HostBudget`; the
returned `Fence` is ready once the copy finished. The source tensors are marked in use by
the side stream, so memory the forward frees meanwhile is not reused under the copy.
Copies in (`to_device`) stage host arrays in pinned memory and copy them on the copier's
own placing stream; `placed()` fences everything enqueued so far.
On the CPU the same calls run without streams: every copy is complete when it returns.

bfloat16 and fp8 have no numpy dtype: they are copied as integer views of the same width
(`movable`), and bfloat16 travels as uint16 (`WIRE`), its bits unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from prfaas.engines.kv_pages.host_copy import Fence
from prfaas.engines.kv_pages.staging import DEFAULT_BUDGET_BYTES, HostBudget

MOVABLE = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}
"""dtypes numpy cannot hold, moved as an integer view of the same width."""
WIRE = {torch.bfloat16: np.dtype(np.uint16)}
"""The wire dtype where it differs from the movable view's (bfloat16 travels as uint16)."""


def movable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a view numpy can hold (bfloat16 and fp8 as integers of the same width)."""
    return tensor.view(MOVABLE[tensor.dtype]) if tensor.dtype in MOVABLE else tensor


def numpy_dtype(dtype: torch.dtype) -> Any:
    """The numpy dtype of torch `dtype`.

    Raises:
        ValueError: the dtype has none (move it as `movable` first).
    """
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError as exc:
        raise ValueError(f"dtype {dtype} cannot travel") from exc


def wire_array(root: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """A host copy of a `dtype` tensor (in its movable form) as it travels (a view)."""
    wire = WIRE.get(dtype)
    return root if wire is None else root.view(wire)


def torch_dtype(wire: np.dtype[Any]) -> torch.dtype:
    """The torch dtype a received array of dtype `wire` holds (uint16 is bfloat16's wire
    form: no model state is uint16)."""
    if wire == np.uint16:
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype=wire)).dtype


class DeviceCopier:
    """Copies out of and into `device`'s memory (see the module docstring)."""

    def __init__(
        self, device: torch.device | str, *, send_budget_bytes: int = DEFAULT_BUDGET_BYTES
    ) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.budget = HostBudget(send_budget_bytes, pinned=cuda)
        self._read_stream: Any = _stream(self.device) if cuda else None
        self._place_stream: Any = _stream(self.device) if cuda else None
        self._place_lock = threading.Lock()
        self._consumer: Any = None  # the stream that called placing(), while it holds the lock

    @property
    def asynchronous(self) -> bool:
        """Whether copies complete later than the call that enqueued them (a GPU)."""
        return self._read_stream is not None

    # -- out of the device -------------------------------------------------------------------

    def to_host(
        self, tensors: Mapping[str, torch.Tensor], index: torch.Tensor | None = None
    ) -> tuple[dict[str, np.ndarray], Fence]:
        """Host copies of `tensors` (rows `index` of each along dim 0, if given) in buffers
        from the budget, in wire form (numpy arrays whose lifetime holds the budget), and
        the fence after which they hold the bytes."""
        out: dict[str, np.ndarray] = {}
        if self._read_stream is None:
            for name, tensor in tensors.items():
                src = movable(tensor)
                shape = (len(index), *src.shape[1:]) if index is not None else tuple(src.shape)
                host, root = self.budget.take(shape, src.dtype)
                if index is None:
                    host.copy_(src)
                else:
                    torch.index_select(src, 0, index, out=host)
                out[name] = wire_array(root, tensor.dtype)
            return out, Fence()
        written = _event()
        written.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._read_stream):
            self._read_stream.wait_event(written)
            on_device = None if index is None else index.to(self.device, non_blocking=True)
            for name, tensor in tensors.items():
                src = movable(tensor)
                src.record_stream(self._read_stream)  # not reused before the copy ran
                picked = src if on_device is None else src.index_select(0, on_device)
                host, root = self.budget.take(tuple(picked.shape), picked.dtype)
                host.copy_(picked, non_blocking=True)
                out[name] = wire_array(root, tensor.dtype)
            copied = _event()
            copied.record(self._read_stream)
        return out, Fence(copied)

    def reads_done(self) -> None:
        """Wait until every copy out of the device enqueued so far has finished."""
        if self._read_stream is not None:
            self._read_stream.synchronize()

    # -- into the device ---------------------------------------------------------------------

    @contextmanager
    def placing(self) -> Iterator[None]:
        """Writes into the device from any thread, one at a time, on the placing stream
        (none on the CPU)."""
        stream = self._place_stream
        with self._place_lock:
            if stream is None:
                yield
                return
            self._consumer = torch.cuda.current_stream(self.device)
            try:
                with torch.cuda.stream(stream):
                    yield
            finally:
                self._consumer = None

    def staged(self, src: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """Host `src` as a tensor of `dtype` (same item size) on the device: on the CPU a
        view of `src`'s memory, on a GPU a copy enqueued through pinned memory on the
        placing stream (call inside `placing()`), marked in use by the stream that called
        `placing()` (which reads it later), so its memory is not reused under that reader."""
        host = torch.from_numpy(np.ascontiguousarray(src).view(numpy_dtype(movable_dtype(dtype))))
        if self._place_stream is None:
            return host.view(dtype)
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        placed = pinned.to(self.device, non_blocking=True)
        placed.record_stream(self._consumer)
        return placed.view(dtype)

    def index(self, values: np.ndarray) -> torch.Tensor:
        """Index values as a tensor on the device (call inside `placing()`)."""
        index = torch.from_numpy(values)
        return index if self._place_stream is None else index.to(self.device, non_blocking=True)

    def placed(self) -> Fence:
        """Marks every write enqueued so far: ready once they are all in device memory."""
        if self._place_stream is None:
            return Fence()
        event = _event()
        event.record(self._place_stream)
        return Fence(event)

    def order_after_placed(self) -> None:
        """Make the caller's current stream (the forward pass) wait, on the device, for
        every write enqueued so far; the host thread does not block."""
        if self._place_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._place_stream)


def movable_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a `dtype` tensor is copied as (see `movable`)."""
    return MOVABLE.get(dtype, dtype)


def _stream(device: torch.device) -> Any:
    """A CUDA stream of the lowest priority (copies yield to the forward's kernels)."""
    return torch.cuda.Stream(device, priority=0)  # type: ignore[no-untyped-call]


def _event() -> Any:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]
