"""Bad inputs to the core: metadata builders, index expansion, layouts, config, allocator.

Every call here is eager, so values are checked by default (`funcmla.guards.should_check`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from funcmla import allocator as alloc
from funcmla import config, indices, metadata as md
from funcmla.layout import PageTable, PoolSpec, TokenCSR
from tests.bad_input import BadInput

R2T = (jnp.arange(4 * 8, dtype=jnp.int32) + 4).reshape(4, 8)  # 4 request rows, max_context_len 8
RPI = jnp.array([0, 1], jnp.int32)
LIMIT = r"2147483647"


def decode(rpi=RPI, seq=(3, 5), r2t=R2T, capacity=16):
    return lambda: md.decode_metadata(r2t, rpi, jnp.asarray(seq) if isinstance(seq, tuple) else seq,
                                      capacity=capacity)


def case(name, call, error, *match):
    return BadInput(name, call, error, tuple(match))


CSR = TokenCSR(jnp.array([0, 2], jnp.int32), jnp.array([5, 6], jnp.int32))
PT = PageTable(jnp.array([[1]], jnp.int32), jnp.array([2], jnp.int32), 4)
SPEC = alloc.AllocatorSpec(num_pages=8, page_size=4, num_req_slots=4, max_context_len=16)

CASES: list[BadInput] = [
    # ---- metadata builders: values ----------------------------------------------------------
    case("metadata.seq_len_over_max_context_len", decode(seq=(3, 9)), ValueError,
         r"seq_lens\[1\] = 9", r"max_context_len = 8"),
    case("metadata.negative_seq_len", decode(seq=(3, -2)), ValueError,
         r"seq_lens\[1\] = -2", r">= 0"),
    case("metadata.req_pool_index_past_table", decode(rpi=jnp.array([0, 4])), ValueError,
         r"req_pool_indices\[1\] = 4", r"request pool \[0, 4\)"),
    case("metadata.negative_req_pool_index", decode(rpi=jnp.array([-1, 0])), ValueError,
         r"req_pool_indices\[0\] = -1", r"\[0, 4\)"),
    case("metadata.req_pool_index_int64_narrowed", decode(rpi=np.array([2**32 + 1, 0])),
         ValueError, r"req_pool_indices\[0\] = 4294967297", r"int32 \(limit " + LIMIT),
    case("metadata.seq_len_int64_narrowed", decode(seq=np.array([2**32 + 3, 1])), ValueError,
         r"seq_lens\[0\] = 4294967299", LIMIT),
    case("metadata.float_req_pool_indices", decode(rpi=jnp.array([0.0, 1.0])), TypeError,
         r"req_pool_indices must be an integer array", r"float32"),
    case("metadata.float_req_to_token", decode(r2t=R2T.astype(jnp.float32)), TypeError,
         r"req_to_token must be an integer array", r"float32"),
    case("metadata.float_seq_lens", decode(seq=jnp.array([3.0, 5.0])), TypeError,
         r"seq_lens must be an integer array", r"float32"),
    case("metadata.bool_seq_lens", decode(seq=jnp.array([True, False])), TypeError,
         r"seq_lens must be an integer array", r"bool"),
    case("metadata.req_to_token_1d", decode(r2t=R2T[0]), ValueError,
         r"req_to_token must be 2-D", r"shape \(8,\)"),
    case("metadata.seq_lens_2d", decode(seq=jnp.ones((2, 1), jnp.int32)), ValueError,
         r"seq_lens must be 1-D", r"shape \(2, 1\)"),
    case("metadata.empty_batch", decode(rpi=jnp.zeros((0,), jnp.int32), seq=jnp.zeros((0,), jnp.int32)),
         ValueError, r"req_pool_indices is empty", r"at least one request"),
    case("metadata.batch_shape_mismatch", decode(seq=(3, 5, 1)), ValueError,
         r"seq_lens must have shape \[batch\]=\(2,\)", r"\(3,\)"),
    case("metadata.live_tokens_over_capacity",
         lambda: md.decode_metadata(jnp.tile(jnp.arange(256, dtype=jnp.int32), (2, 1)),
                                    RPI, jnp.array([250, 221]), capacity=64),
         ValueError, r"sum\(seq_lens\) = 471", r"the buffer capacity 64"),
    case("metadata.capacity_not_positive", decode(capacity=0), ValueError,
         r"capacity must be a positive int", r"got 0"),
    case("metadata.capacity_not_int", decode(capacity=16.0), ValueError,
         r"capacity must be a positive int", r"got 16\.0"),
    case("metadata.extend_queries_over_keys",
         lambda: md.extend_metadata(R2T, RPI, jnp.array([2, 3]), jnp.array([2, 4]), capacity=8),
         ValueError, r"extend_seq_lens\[1\] = 4", r"seq_lens\[1\] = 3"),
    case("metadata.extend_negative_queries",
         lambda: md.extend_metadata(R2T, RPI, jnp.array([2, 3]), jnp.array([-1, 1]), capacity=8),
         ValueError, r"extend_seq_lens\[0\] = -1", r"\[0, seq_lens\]"),
    case("metadata.extend_shape_mismatch",
         lambda: md.extend_metadata(R2T, RPI, jnp.array([2, 3]), jnp.array([1]), capacity=8),
         ValueError, r"extend_seq_lens must have shape \[batch\]=\(2,\)", r"\(1,\)"),
    case("metadata.num_draft_tokens_not_positive",
         lambda: md.target_verify_metadata(R2T, RPI, jnp.array([2, 3]), num_draft_tokens=0,
                                           capacity=16),
         ValueError, r"num_draft_tokens must be a positive int", r"got 0"),
    case("metadata.target_verify_past_max_context_len",
         lambda: md.target_verify_metadata(R2T, RPI, jnp.array([6, 3]), num_draft_tokens=3,
                                           capacity=32),
         ValueError, r"seq_lens\[0\] = 6", r"max_context_len - num_draft_tokens = 8 - 3"),
    case("metadata.draft_extend_fewer_keys_than_drafts",
         lambda: md.draft_extend_metadata(R2T, RPI, jnp.array([2, 5]), num_draft_tokens=3,
                                          capacity=32),
         ValueError, r"num_draft_tokens\[0\] = 3", r"seq_lens\[0\] = 2"),
    case("metadata.unknown_mode",
         lambda: md.build_metadata("prefill", R2T, RPI, jnp.array([2, 3]), capacity=8),
         ValueError, r"mode must be one of", r"'prefill'"),
    case("metadata.extend_without_extend_seq_lens",
         lambda: md.build_metadata("extend", R2T, RPI, jnp.array([2, 3]), capacity=8),
         ValueError, r"mode 'extend'", r"extend_seq_lens"),
    case("metadata.forward_metadata_mode",
         lambda: md.ForwardMetadata(*([jnp.zeros(2, jnp.int32)] * 4), jnp.int32(1), jnp.int32(1),
                                    mode="verify"),
         ValueError, r"ForwardMetadata\.mode", r"'verify'"),
    case("metadata.buffer_plan_page_size", lambda: md.BufferPlan(4, 64, page_size=3), ValueError,
         r"BufferPlan\.page_size must be a power of two", r"got 3"),
    case("metadata.buffer_plan_max_bs", lambda: md.BufferPlan(0, 64), ValueError,
         r"BufferPlan\.max_bs must be a positive int", r"got 0"),
    case("metadata.buffer_plan_num_draft_tokens",
         lambda: md.BufferPlan(4, 64, num_draft_tokens=-1), ValueError,
         r"BufferPlan\.num_draft_tokens", r"got -1"),
    # ---- index expansion --------------------------------------------------------------------
    case("indices.negative_kv_start",
         lambda: indices.gather_token_indices(R2T, RPI, jnp.array([2, 2]), jnp.array([0, -3]),
                                              capacity=8),
         ValueError, r"kv_start\[1\] = -3", r">= 0"),
    case("indices.kv_start_plus_len_past_row",
         lambda: indices.gather_token_indices(R2T, RPI, jnp.array([4, 2]), jnp.array([6, 0]),
                                              capacity=8),
         ValueError, r"kv_start \+ kv_lens\[0\] = 10", r"max_context_len = 8"),
    case("indices.float_kv_start",
         lambda: indices.gather_token_indices(R2T, RPI, jnp.array([2, 2]), jnp.array([0.0, 1.0]),
                                              capacity=8),
         TypeError, r"kv_start must be an integer array", r"float32"),
    case("indices.kv_lens_total_past_int32",
         lambda: indices.indptr_from_lens(np.array([2**31 - 1, 5])), ValueError,
         r"sum\(lens\) = 2147483652", r"int32 limit " + LIMIT),
    case("indices.capacity_bool",
         lambda: indices.gather_token_indices(R2T, RPI, jnp.array([2, 2]), capacity=True),
         ValueError, r"capacity must be a positive int", r"got True"),
    case("indices.page_size_not_power_of_two",
         lambda: indices.page_table_from_token_slots(R2T, RPI, jnp.array([2, 2]), page_size=6,
                                                     max_pages=2),
         ValueError, r"page_size must be a power of two", r"got 6"),
    case("indices.pages_past_max_pages",
         lambda: indices.page_table_from_token_slots(R2T, RPI, jnp.array([8, 2]), page_size=2,
                                                     max_pages=3),
         ValueError, r"kv_lens\[0\] = 8", r"max_pages \* page_size = 6"),
    case("indices.max_pages_not_positive",
         lambda: indices.page_table_from_token_slots(R2T, RPI, jnp.array([2, 2]), page_size=2,
                                                     max_pages=0),
         ValueError, r"max_pages must be a positive int", r"got 0"),
    case("indices.csr_where_page_table_expected",
         lambda: indices.token_slots_from_page_table(CSR, capacity=4), TypeError,
         r"page_table: expected a PageTable", r"got TokenCSR"),
    case("indices.page_table_where_csr_expected",
         lambda: indices.page_table_from_csr(PT, page_size=4, max_pages=2), TypeError,
         r"kv: expected a TokenCSR", r"got PageTable"),
    case("indices.page_table_length_past_its_pages",
         lambda: indices.token_slots_from_page_table(
             PageTable(jnp.array([[1, 2]], jnp.int32), jnp.array([9], jnp.int32), 4), capacity=16),
         ValueError, r"page_table\.lengths\[0\] = 9", r"max_pages \* page_size = 8"),
    case("indices.page_table_tokens_past_capacity",
         lambda: indices.token_slots_from_page_table(
             PageTable(jnp.array([[1, 2], [3, 0]], jnp.int32), jnp.array([8, 3], jnp.int32), 4),
             capacity=10),
         ValueError, r"kv_indptr\[-1\] = 11", r"buffer capacity 10"),
    case("indices.last_page_len_page_size",
         lambda: indices.kv_last_page_len(jnp.array([3]), page_size=0), ValueError,
         r"page_size must be a power of two", r"got 0"),
    # ---- layouts ----------------------------------------------------------------------------
    case("layout.page_table_page_size",
         lambda: PageTable(jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32), 5), ValueError,
         r"PageTable\.page_size must be a power of two", r"got 5"),
    case("layout.pool_page_size", lambda: PoolSpec(4, 12), ValueError,
         r"PoolSpec\.page_size must be a power of two", r"got 12"),
    case("layout.pool_num_pages", lambda: PoolSpec(0, 4), ValueError,
         r"PoolSpec\.num_pages must be a positive int", r"got 0"),
    # ---- config -----------------------------------------------------------------------------
    case("config.mla_num_heads", lambda: config.MLADims(num_heads=0), ValueError,
         r"MLADims\.num_heads must be a positive int", r"got 0"),
    case("config.mla_v_head_dim", lambda: config.MLADims(v_head_dim=600), ValueError,
         r"MLADims\.v_head_dim=600", r"576"),
    case("config.mla_sm_scale", lambda: config.MLADims(sm_scale=float("nan")), ValueError,
         r"MLADims\.sm_scale must be positive and finite", r"nan"),
    case("config.device_num_cu", lambda: config.custom_device(0), ValueError,
         r"DeviceProfile\.num_cu must be a positive int", r"got 0"),
    case("config.device_arch", lambda: config.custom_device(8, arch="sm80"), ValueError,
         r"DeviceProfile\.arch", r"'sm80'"),
    case("config.unknown_device", lambda: config.get_device_profile("tpu9"), ValueError,
         r"unknown device profile", r"'tpu9'"),
    # ---- allocator --------------------------------------------------------------------------
    case("allocator.spec_page_size", lambda: alloc.AllocatorSpec(8, 3, 4, 16), ValueError,
         r"AllocatorSpec\.page_size must be a power of two", r"got 3"),
    case("allocator.spec_slots_past_int32", lambda: alloc.AllocatorSpec(2**29, 8, 4, 16),
         ValueError, r"\(num_pages \+ 1\) \* page_size = 4294967304", r"int32"),
    case("allocator.spec_num_req_slots", lambda: alloc.AllocatorSpec(8, 4, 0, 16), ValueError,
         r"AllocatorSpec\.num_req_slots must be a positive int", r"got 0"),
    case("allocator.float_seq_lens",
         lambda: alloc.alloc_decode(alloc.init_allocator(SPEC), jnp.array([0]), jnp.array([1.0])),
         TypeError, r"alloc_decode: seq_lens must be an integer array", r"float32"),
    case("allocator.req_pool_index_int64_narrowed",
         lambda: alloc.alloc_decode(alloc.init_allocator(SPEC), np.array([2**32 + 1]),
                                    np.array([1])),
         ValueError, r"alloc_decode: req_pool_indices\[0\] = 4294967297", LIMIT),
    case("allocator.empty_batch",
         lambda: alloc.alloc_decode(alloc.init_allocator(SPEC), jnp.zeros((0,), jnp.int32),
                                    jnp.zeros((0,), jnp.int32)),
         ValueError, r"alloc_decode: per-request arrays", r"shape \(0,\)"),
    case("allocator.extend_capacity",
         lambda: alloc.alloc_extend(alloc.init_allocator(SPEC), jnp.array([0]), jnp.array([0]),
                                    jnp.array([4]), capacity=0),
         ValueError, r"alloc_extend: capacity must be a positive int", r"got 0"),
    case("allocator.init_not_a_spec", lambda: alloc.init_allocator(PoolSpec(8, 4)), TypeError,
         r"init_allocator: spec must be an AllocatorSpec", r"PoolSpec"),
    case("allocator.status_raised",
         lambda: alloc.raise_for_status(alloc.alloc_decode(
             alloc.init_allocator(SPEC), jnp.array([7]), jnp.array([1])), "alloc_decode"),
         alloc.AllocatorError, r"alloc_decode failed", r"BAD_REQUEST_INDEX"),
]
