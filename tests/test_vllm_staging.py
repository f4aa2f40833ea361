"""The connector's staging buffers: pages copied out of a KV cache into reused host tensors."""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.integrations.vllm.staging import MIN_BLOCKS, StagingPool, copy_pages_out


def _kv(blocks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(blocks, 2, 16, 4, 32, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize(
    "ids",
    [
        list(range(10, 40)),  # one run
        [5, 6, 7, 20, 21, 3, 4, 50],  # several runs, out of order
        random.Random(1).sample(range(64), 40),  # scattered
    ],
)
@pytest.mark.parametrize("contiguous", [True, False])
def test_copy_pages_out_matches_a_gather(ids: list[int], contiguous: bool) -> None:
    kv = _kv(64)
    if not contiguous:  # the same pages inside a wider tensor: only each page is contiguous
        wide = torch.zeros(64, 3, 2, 16, 4, 32, dtype=torch.bfloat16)
        wide[:, 1] = kv
        kv = wide[:, 1]
        assert not kv.is_contiguous() and kv[0].is_contiguous()
    pool = StagingPool(1 << 30)
    buf = pool.take(kv[0], len(ids))
    assert buf.shape[0] >= len(ids)
    out = copy_pages_out(kv, ids, buf)
    assert torch.equal(out, kv.index_select(0, torch.tensor(ids)))


def test_pool_reuses_buffers_and_bounds_idle_bytes() -> None:
    kv = _kv(4)
    page = kv[0]
    pool = StagingPool(limit_bytes=3 * MIN_BLOCKS * page.nbytes)
    a = pool.take(page, 10)
    b = pool.take(page, 16)  # same size class: MIN_BLOCKS pages
    c = pool.take(page, 17)  # the next power of two
    assert (a.shape[0], b.shape[0], c.shape[0]) == (MIN_BLOCKS, MIN_BLOCKS, 2 * MIN_BLOCKS)
    assert pool.allocated == 3
    pool.give([a, b, c])  # c does not fit under the limit after a and b: freed
    assert pool.idle_bytes == 2 * MIN_BLOCKS * page.nbytes
    again = pool.take(page, 3)
    assert again.data_ptr() in (a.data_ptr(), b.data_ptr()) and pool.allocated == 3
    other = pool.take(page.to(torch.float32), 3)  # another dtype: another buffer
    assert other.dtype == torch.float32 and pool.allocated == 4


def test_out_bytes_counts_buffers_until_they_come_back() -> None:
    """``out_bytes`` (the connector's ``staging_out_bytes`` gauge): taken and not yet given back,
    whether a given-back buffer is kept for reuse or freed beyond the limit."""
    page = _kv(1)[0]
    pool = StagingPool(limit_bytes=MIN_BLOCKS * page.nbytes)
    a, b = pool.take(page, 4), pool.take(page, 4)
    assert pool.out_bytes == a.nbytes + b.nbytes
    pool.give([a, b])  # a is kept, b is beyond the limit and freed: neither is out
    assert pool.out_bytes == 0 and pool.idle_bytes == a.nbytes
    c = pool.take(page, 4)  # reused
    assert pool.out_bytes == c.nbytes and pool.idle_bytes == 0
    pool.give([c])
    assert pool.out_bytes == 0
