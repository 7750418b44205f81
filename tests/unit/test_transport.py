"""Packing publish buckets for the wire (workers/transport.py): exact round trips, no copies,
no whole storages; and the staging a weight store's pull reads."""

from __future__ import annotations

import pickle

import pytest
import torch

from resilient_rl.workers.transport import ObjectStoreTransport, pack, unpack


def test_views_of_one_buffer_pack_without_the_rest_of_the_buffer_and_round_trip() -> None:
    buf = torch.zeros(1 << 20, dtype=torch.uint8)  # 1 MiB, of which the bucket uses 72 bytes
    a = buf[0:64].view(torch.float32).view(4, 4).copy_(torch.arange(16.0).view(4, 4))
    b = buf[64:72].view(torch.bfloat16).copy_(torch.tensor([1.5, -2.0, 3.0, 0.25]))
    packed = pack([("a", a), ("b", b)])
    assert len(pickle.dumps(packed, protocol=5)) < 4096  # the views' bytes only, not the 1 MiB
    assert [raw.ctypes.data for *_, raw in packed] == [a.data_ptr(), b.data_ptr()]  # no copy was made
    out = dict(unpack(packed))
    assert torch.equal(out["a"], a) and out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], b)


def test_every_dtype_and_shape_round_trips_and_only_a_non_contiguous_tensor_is_copied() -> None:
    odd = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    big = torch.randn(5, 7)
    scalar = torch.tensor(7, dtype=torch.int64)
    flags = torch.tensor([True, False, True])
    empty = torch.empty(0, 3)
    strided = torch.randn(6, 4).t()  # not contiguous
    bucket = [("odd", odd), ("big", big), ("scalar", scalar), ("flags", flags), ("empty", empty), ("strided", strided)]
    packed = pack(bucket)
    out = dict(unpack(pickle.loads(pickle.dumps(packed, protocol=5))))
    for name, t in bucket:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t), name
    big.add_(1)
    strided.add_(1)
    live = dict(unpack(packed))
    assert torch.equal(live["big"], big)  # a view: the caller must not change it before the store has it
    assert not torch.equal(live["strided"], strided)  # the one copy


def test_an_empty_bucket_packs_to_nothing() -> None:
    assert pack([]) == [] and list(unpack([])) == []


def test_export_answers_only_the_staged_bucket_and_names_what_is_staged() -> None:
    t = ObjectStoreTransport(store=object(), source=object())
    with pytest.raises(RuntimeError, match="bucket 0 of version 3 is not staged here \\(nothing is\\)"):
        t.export(3, 0)
    t.staged = (3, 1, pack([("w", torch.ones(2))]))
    assert t.export(3, 1)[0] == 1
    with pytest.raises(RuntimeError, match="\\(bucket 1 of version 3 is\\)"):
        t.export(3, 2)


def test_a_transport_through_a_store_needs_the_source_the_store_pulls_from() -> None:
    with pytest.raises(ValueError, match="needs the source actor"):
        ObjectStoreTransport(store=object())
