"""Packing publish buckets for the wire (workers/transport.py): exact round trips, no whole storages."""

from __future__ import annotations

import pickle

import torch

from resilient_rl.workers.transport import pack, unpack


def test_views_of_one_buffer_pack_without_the_rest_of_the_buffer_and_round_trip() -> None:
    buf = torch.zeros(1 << 20, dtype=torch.uint8)  # 1 MiB, of which the bucket uses 128 bytes
    a = buf[0:64].view(torch.float32).view(4, 4).copy_(torch.arange(16.0).view(4, 4))
    b = buf[64:72].view(torch.bfloat16).copy_(torch.tensor([1.5, -2.0, 3.0, 0.25]))
    flat, entries = pack([("a", a), ("b", b)])
    assert len(pickle.dumps((flat, entries), protocol=5)) < 4096  # the view's bytes only, not the 1 MiB
    assert flat.ctypes.data == buf.data_ptr()  # no copy was made
    out = dict(unpack((flat, entries)))
    assert torch.equal(out["a"], a) and out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], b)


def test_unrelated_tensors_are_copied_at_aligned_offsets_whatever_their_dtypes() -> None:
    odd = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)  # 6 bytes: the next would be misaligned
    big = torch.randn(5, 7)
    scalar = torch.tensor(7, dtype=torch.int64)
    flat, entries = pack([("odd", odd), ("big", big), ("scalar", scalar)])
    assert all(off % 64 == 0 for *_, off in entries)
    out = dict(unpack((flat, entries)))
    assert torch.equal(out["odd"], odd) and torch.equal(out["big"], big) and out["scalar"].item() == 7
    big.add_(1)  # a copy: later changes to the source do not reach the packed bucket
    assert not torch.equal(dict(unpack((flat, entries)))["big"], big)


def test_an_empty_bucket_packs_to_nothing() -> None:
    flat, entries = pack([])
    assert flat.size == 0 and entries == [] and list(unpack((flat, entries))) == []
