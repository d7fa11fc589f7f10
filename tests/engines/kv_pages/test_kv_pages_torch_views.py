"""`as_numpy`: torch tensors (bfloat16, strided) as numpy views that share memory."""

from __future__ import annotations

import numpy as np
import torch

from prfaas.engines.kv_pages import PagedPool
from prfaas.engines.kv_pages.torch_views import as_numpy


def test_bf16_strided_view_shares_memory_with_the_tensor() -> None:
    """A page written through a pool built on a transposed bf16 view lands in the tensor,
    bit for bit, and a gather reads the tensor's bits."""
    cache = torch.randn(2, 4, 3, 8, 5).to(torch.bfloat16)  # (kv, pages, heads, page, dim)
    k = as_numpy(cache.transpose(2, 3)[0])  # (pages, page, heads, dim), strided
    assert k.dtype == np.uint16 and k.shape == (4, 8, 3, 5)
    pool = PagedPool(pages={0: {"k": k}})
    page = np.arange(8 * 3 * 5, dtype=np.uint16).reshape(1, 8, 3, 5)
    pool.scatter(0, {"k": page}, first_token=16, block_ids=[3, 1, 0])
    want = torch.from_numpy(page[0].astype(np.int32)).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(cache[0, 0].transpose(0, 1).view(torch.int16), want.view(torch.int16))
    assert (
        pool.gather(0, [2]).arrays()["k"].tobytes()
        == cache[0, 2].transpose(0, 1).contiguous().view(torch.uint16).numpy().tobytes()
    )
