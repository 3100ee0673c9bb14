"""bench.tma_stream without a GPU: its layouts and cases (what fits, named errors), the stream
kernel in Mosaic GPU interpret mode (every tile of every split streamed once, TMA pages and the
row gather) and its export for CUDA at every default layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import tma_stream
from funcmla.attention.pallas.decode_common import split_tile_range


def test_parse_layout_reads_the_fields_and_the_stage_bytes():
    lay = tma_stream.parse_layout("fp8_576_sw64_s4")
    assert (lay.dtype, lay.width, lay.swizzle, lay.stages) == ("fp8", 576, 64, 4)
    assert lay.stage_bytes == 64 * 576 and lay.name == "fp8_576_sw64_s4"
    assert tma_stream.parse_layout("bf16_576_sw128_s2").stage_bytes == 64 * 576 * 2


@pytest.mark.parametrize("text,match", [
    ("fp8_576_64_s4", "is not <fp8|bf16>_<width>_sw<swizzle>_s<stages>"),
    ("int8_576_sw64_s4", "is not <fp8|bf16>"),
    ("fp8_576_sw128_s4", "width 576 is not a positive multiple of the swizzle tile's 128"),
    ("bf16_576_sw16_s2", "swizzle 16 is not 32, 64 or 128"),
    ("fp8_576_sw64_s7", "7 stages of 36864 bytes do not fit"),
    ("bf16_576_sw128_s4", "4 stages of 73728 bytes do not fit"),
    ("fp8_576_sw64_s0", "0 stages")])
def test_parse_layout_names_what_does_not_fit(text, match):
    with pytest.raises(ValueError, match=match):
        tma_stream.parse_layout(text)


def test_parse_stream_case():
    assert tma_stream.parse_stream_case("b128_ctx16k_p64") == (128, 16384, 64)
    for bad in ("b128_ctx16_p64", "h16_b128_ctx16k_p64", "b0_ctx4k_p1"):
        with pytest.raises(ValueError, match="b<batch>_ctx<k>k_p<page>"):
            tma_stream.parse_stream_case(bad)


@pytest.mark.parametrize("layout,page_size,splits", [
    ("fp8_576_sw64_s4", 64, 2), ("fp8_576_sw64_s2", 1, 3), ("bf16_128_sw128_s2", 16, 1)])
def test_interpret_stream_kernel_streams_every_tile_once(layout, page_size, splits):
    """Each block reports the tiles it waited for: split_tile_range's count of its sequence
    and split (full and partial tiles, an empty split), so the producer filled and the consumer
    released every stage in step."""
    lay = tma_stream.parse_layout(layout)
    b, ctx = 2, 200  # 4 tiles, the last partial
    kv, slots = tma_stream.case_metadata(jax.random.PRNGKey(1), b, ctx, page_size)
    pool = tma_stream._pool(jax.random.PRNGKey(2), slots, lay)
    counts = np.asarray(tma_stream.stream_call(pool, kv, num_splits=splits, lay=lay,
                                               interpret=True))
    want = []
    for _ in range(b):
        for s in range(splits):
            first, last = split_tile_range(ctx, s, splits, 64)
            want.append(max(int(last) - int(first), 0))
    assert counts.shape == (b * splits, 128)
    np.testing.assert_array_equal(counts, np.repeat(np.array(want)[:, None], 128, axis=1))


@pytest.mark.parametrize("layout", tma_stream.DEFAULT_LAYOUTS.split(","))
@pytest.mark.parametrize("page_size", [64, 1])
def test_stream_kernel_exports_for_cuda(layout, page_size):
    lay = tma_stream.parse_layout(layout)
    kv, slots = tma_stream.case_metadata(jax.random.PRNGKey(0), 2, 1024, page_size)
    dtype = jnp.float8_e4m3fn if lay.dtype == "fp8" else jnp.bfloat16
    pool = jax.ShapeDtypeStruct((slots, lay.width), dtype)
    fn = jax.jit(lambda pool, kv: tma_stream.stream_call(pool, kv, num_splits=2, lay=lay))
    text = jax.export.export(fn, platforms=["cuda"])(pool, kv).mlir_module()
    assert f"tma_stream_{layout}_ps{page_size}" in text
