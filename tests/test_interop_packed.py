"""Packed step buffer: exact round trip of every field, torch views alias the one buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.interop.dlpack import data_ptr, to_torch
from funcmla.interop.packed import PackedLayout

shapes = st.lists(
    st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6
)


# Every example has new field shapes, so its eager pack/unpack ops compile anew (~5 programs,
# ~0.15 s an example): 12 examples, each of 1-6 fields of rank 0-3 with empty dimensions.
@settings(max_examples=12)
@given(shapes=shapes, align=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**31 - 1))
def test_pack_then_views_round_trip_every_field(shapes, align, seed):
    layout = PackedLayout(tuple((f"f{i}", s) for i, s in enumerate(shapes)), align)
    rng = np.random.default_rng(seed)
    fields = {n: rng.integers(-(2**31), 2**31 - 1, size=s, dtype=np.int64).astype(np.int32)
              for n, s in layout.fields}
    buf = layout.pack({n: jnp.asarray(v) for n, v in fields.items()})
    assert buf.shape == (layout.size,) and buf.dtype == jnp.int32
    # offsets are aligned, increasing, and fields do not overlap
    offs = layout.offsets
    ends = [offs[n] + int(np.prod(s)) for n, s in layout.fields]
    assert all(offs[n] % align == 0 for n in layout.names)
    assert all(e <= offs[m] for e, m in zip(ends, layout.names[1:]))
    assert max(ends) <= layout.size
    t = to_torch(buf)
    views = layout.torch_views(t)
    unpacked = layout.unpack(buf)
    for name, want in fields.items():
        np.testing.assert_array_equal(views[name].numpy(), want)
        np.testing.assert_array_equal(np.asarray(unpacked[name]), want)
        assert tuple(views[name].shape) == want.shape
        if want.size:
            assert views[name].data_ptr() == t.data_ptr() + 4 * offs[name]  # a view, no copy
    # padding is zero
    live = np.zeros(layout.size, bool)
    for name, s in layout.fields:
        live[offs[name] : offs[name] + int(np.prod(s))] = True
    assert not np.asarray(buf)[~live].any()


def test_pack_is_one_array_leaving_jit_and_views_are_64_byte_aligned():
    layout = PackedLayout.of(kv_indptr=(5,), kv_indices=(100,), qo_indptr=(5,),
                             kv_last_page_len=(4,), max_q_len=(), max_kv_len=())

    @jax.jit
    def build(lens):
        indptr = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens)])
        return layout.pack(dict(kv_indptr=indptr, kv_indices=jnp.arange(100),
                                qo_indptr=jnp.arange(5), kv_last_page_len=jnp.ones(4, jnp.int32),
                                max_q_len=jnp.int32(1), max_kv_len=jnp.max(lens)))

    buf = build(jnp.array([3, 1, 4, 1], jnp.int32))
    t = to_torch(buf)
    assert t.data_ptr() == data_ptr(buf)
    v = layout.torch_views(t)
    assert all(x.data_ptr() % 64 == 0 for x in v.values())
    assert v["kv_indptr"].tolist() == [0, 3, 4, 8, 9]
    assert v["max_kv_len"].item() == 4 and v["max_kv_len"].shape == ()
    # a static buffer with the same layout takes a new step with one copy, views unchanged
    static = layout.empty_torch()
    sv = layout.torch_views(static)
    ptrs = {k: x.data_ptr() for k, x in sv.items()}
    static.copy_(to_torch(build(jnp.array([2, 2, 2, 7], jnp.int32))))
    assert sv["kv_indptr"].tolist() == [0, 2, 4, 6, 13] and sv["max_kv_len"].item() == 7
    assert {k: x.data_ptr() for k, x in sv.items()} == ptrs


def test_pack_errors_name_the_field():
    layout = PackedLayout.of(a=(3,), b=(2, 2))
    with pytest.raises(ValueError, match=r"missing fields \['b'\]"):
        layout.pack(dict(a=jnp.zeros(3, jnp.int32)))
    with pytest.raises(ValueError, match=r"field 'b' has shape \(4,\), layout says \(2, 2\)"):
        layout.pack(dict(a=jnp.zeros(3, jnp.int32), b=jnp.zeros(4, jnp.int32)))
    with pytest.raises(TypeError, match="field 'a' has dtype float32"):
        layout.pack(dict(a=jnp.zeros(3, jnp.float32), b=jnp.zeros((2, 2), jnp.int32)))
    with pytest.raises(ValueError, match="duplicate field names"):
        PackedLayout((("a", (1,)), ("a", (2,))))
    with pytest.raises(ValueError, match=r"packed buffer has shape \(7,\)"):
        layout.torch_views(torch.zeros(7, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        layout.torch_views(torch.zeros(layout.size, dtype=torch.int64))
