"""Bad inputs to the SGLang backend (FuncMLAAttnBackend): modes, bucket and CUDA-graph limits,
IDLE batches, and the step values checked from SGLang's host mirrors with no device sync.
`tests/test_interop_sglang_checks.py` also checks that none of them launches work or writes a
buffer."""

from __future__ import annotations

import enum
import functools

from tests.bad_input import BadInput


@functools.lru_cache(maxsize=None)
def shared():
    """(backend with a captured decode graph at bs 2 and 8, ForwardMode, helpers), built once."""
    import numpy as np
    import torch

    from funcmla.interop.sglang_backend import (
        Buckets,
        FuncMLAAttnBackend,
        MLATokenToKVPool,
    )

    r2t = torch.from_numpy(np.arange(16 * 256, dtype=np.int32).reshape(16, 256) + 64).clone()
    pool = MLATokenToKVPool(16 * 256 + 64, 1, torch.bfloat16, 1)
    be = FuncMLAAttnBackend(r2t, pool, num_heads=16, num_draft_tokens=2,
                            buckets=Buckets(batch_sizes=(2, 8), min_kv_tokens=4096),
                            attention_backend="reference")
    be.init_cuda_graph_state(8, 16)
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    from funcmla.interop.sglang_backend import ForwardMode

    for bs in (2, 8):
        be.init_forward_metadata_capture_cuda_graph(bs, bs, t(list(range(bs))), t([5] * bs),
                                                    None, ForwardMode.DECODE, None)
    return be


def _t(x, dtype=None):
    import torch

    return torch.tensor(x, dtype=dtype or torch.int32)


def _fb(mode="DECODE", rows=(0, 1), seq=(6, 10), seq_cpu=None, seq_sum=None, ext=None,
        ext_cpu=None, out=None, batch=None, spec=None, rows_dtype=None, seq_dtype=None):
    from funcmla.interop.sglang_backend import ForwardBatch, ForwardMode

    seq_cpu = list(seq) if seq_cpu is None else seq_cpu
    q = sum(ext_cpu or ext or []) if ext is not None else len(rows)
    return ForwardBatch(
        forward_mode=ForwardMode[mode] if isinstance(mode, str) else mode,
        batch_size=len(rows) if batch is None else batch,
        req_pool_indices=_t(list(rows), rows_dtype), seq_lens=_t(list(seq), seq_dtype),
        seq_lens_cpu=_t(seq_cpu), seq_lens_sum=sum(seq_cpu) if seq_sum is None else seq_sum,
        out_cache_loc=_t([0] * q) if out is None else _t([0] * out),
        extend_seq_lens=None if ext is None else _t(list(ext)),
        extend_seq_lens_cpu=ext_cpu if ext_cpu is not None else (None if ext is None else list(ext)),
        spec_info=spec)


def _eager(**kw):
    return lambda: shared().init_forward_metadata(_fb(**kw))


def _replay(bs=2, rows=(0, 1), seq=(6, 10), seq_cpu=None, seq_sum=None, mode="DECODE"):
    def call():
        from funcmla.interop.sglang_backend import ForwardMode

        cpu = list(seq) if seq_cpu is None else seq_cpu
        shared().init_forward_metadata_replay_cuda_graph(
            bs, _t(list(rows)), _t(list(seq)), sum(cpu) if seq_sum is None else seq_sum, None,
            ForwardMode[mode], None, _t(cpu))
    return call


def _resolve(mode):
    def call():
        from funcmla.interop.sglang_backend import resolve_mode

        resolve_mode(mode)
    return call


def _capture_extend():
    from funcmla.interop.sglang_backend import ForwardMode

    shared().init_forward_metadata_capture_cuda_graph(2, 2, _t([0, 1]), _t([5, 5]), None,
                                                      ForwardMode.EXTEND, None)


def _bad_req_to_token():
    import torch

    from funcmla.interop.sglang_backend import FuncMLAAttnBackend

    FuncMLAAttnBackend(torch.zeros(4, 8, dtype=torch.int64), shared().token_to_kv_pool)


def _bad_buckets():
    from funcmla.interop.sglang_backend import Buckets

    Buckets(batch_sizes=(8, 4))


def _idle(**kw):
    from funcmla.interop.sglang_backend import ForwardBatch, ForwardMode

    e = _t([])
    fields = dict(forward_mode=ForwardMode.IDLE, batch_size=0, req_pool_indices=e, seq_lens=e,
                  seq_lens_cpu=e, seq_lens_sum=0, out_cache_loc=e)
    fields.update(kw)
    return lambda: shared().init_forward_metadata(ForwardBatch(**fields))


Unknown = enum.Enum("Unknown", "SOMETHING_NEW")


def _step_launcher_on_cpu():
    import torch

    from funcmla.interop.sglang.step import StepSpec
    from funcmla.interop.sglang.step_launch import StepLauncher

    StepLauncher(StepSpec("decode", 4, 64), torch.zeros((2, 16), dtype=torch.int32))


def _cases():
    import torch

    from funcmla.interop.sglang.step_launch import StepLauncherUnavailable

    from funcmla.interop.sglang_backend import BucketOverflow, CudaGraphBufferOverflow

    f32 = torch.float32
    return [
        BadInput("backend.mode_unknown", _resolve(Unknown.SOMETHING_NEW), ValueError,
                 ("forward_mode", "SOMETHING_NEW", "unknown")),
        BadInput("backend.mode_bare_int", _resolve(3), ValueError, ("forward_mode=3", "by name")),
        BadInput("backend.mode_unsupported", _eager(mode="DLLM_EXTEND"), ValueError,
                 ("forward_mode DLLM_EXTEND", "not supported")),
        BadInput("backend.batch_over_largest_bucket", _eager(rows=range(9), seq=[5] * 9),
                 BucketOverflow, ("batch_size 9", "largest batch bucket 8")),
        BadInput("backend.replay_bs_over_graph_capacity",
                 _replay(bs=9, rows=range(9), seq=[5] * 9), CudaGraphBufferOverflow,
                 ("bs = 9", "max_bs = 8")),
        BadInput("backend.replay_bs_not_captured", _replay(bs=3, rows=(0, 1, 2), seq=(5, 5, 5)),
                 ValueError, ("no CUDA graph was captured", "bs = 3")),
        BadInput("backend.idle_batch_size", _idle(batch_size=2), ValueError,
                 ("IDLE batch must have batch_size 0", "got 2")),
        BadInput("backend.idle_nonempty_tensors", _idle(seq_lens=_t([3, 4])), ValueError,
                 ("IDLE batch must be empty", "forward_batch.seq_lens has 2 entries")),
        BadInput("backend.empty_batch_not_idle", _eager(rows=(), seq=()), ValueError,
                 ("batch_size is 0", "must be IDLE")),
        BadInput("backend.seq_len_over_max_context", _eager(seq=(6, 400)), ValueError,
                 (r"seq_lens_cpu\[1\] = 400", "max_context_len = 256")),
        BadInput("backend.target_verify_over_max_context",
                 _eager(mode="TARGET_VERIFY", seq=(6, 255), out=4), ValueError,
                 (r"seq_lens_cpu\[1\] = 255 \+ 2 draft tokens", "max_context_len = 256")),
        BadInput("backend.seq_len_negative", _eager(seq=(-3, 10)), ValueError,
                 (r"seq_lens_cpu\[0\] = -3", "minimum 1")),
        BadInput("backend.seq_len_zero_decode", _eager(seq=(0, 10)), ValueError,
                 (r"seq_lens_cpu\[0\] = 0", "minimum 1")),
        BadInput("backend.req_pool_index_out_of_range", _eager(rows=(0, 99)), ValueError,
                 (r"req_pool_indices\[1\] = 99", "16 rows")),
        BadInput("backend.req_pool_index_negative", _eager(rows=(-1, 1)), ValueError,
                 (r"req_pool_indices\[0\] = -1", "negative")),
        BadInput("backend.req_pool_indices_float", _eager(rows_dtype=f32), TypeError,
                 ("req_pool_indices", "integer tensor", "float32")),
        BadInput("backend.seq_lens_float", _eager(seq_dtype=f32), TypeError,
                 ("seq_lens", "integer tensor", "float32")),
        BadInput("backend.seq_lens_cpu_disagrees", _eager(seq=(40, 40), seq_cpu=[6, 10]),
                 ValueError, (r"seq_lens\[0\] = 40", r"seq_lens_cpu\[0\] = 6")),
        BadInput("backend.seq_lens_sum_disagrees", _eager(seq_sum=99), ValueError,
                 ("seq_lens_sum = 99", r"sum\(seq_lens_cpu\) = 16")),
        BadInput("backend.seq_lens_cpu_missing",
                 lambda: shared().init_forward_metadata(
                     __import__("dataclasses").replace(_fb(), seq_lens_cpu=None)),
                 ValueError, ("seq_lens_cpu is required",)),
        BadInput("backend.seq_lens_cpu_not_on_host",
                 lambda: shared().init_forward_metadata(__import__("dataclasses").replace(
                     _fb(), seq_lens_cpu=_t([6, 10]).to("meta"))),
                 ValueError, ("seq_lens_cpu must be a host tensor", "meta")),
        BadInput("backend.seq_lens_cpu_bfloat16",  # a dtype NumPy lacks
                 lambda: shared().init_forward_metadata(__import__("dataclasses").replace(
                     _fb(), seq_lens_cpu=_t([6, 10], torch.bfloat16))),
                 TypeError, ("seq_lens_cpu must hold integers", "bfloat16")),
        BadInput("backend.seq_lens_cpu_short", _eager(seq_cpu=[6]), ValueError,
                 ("seq_lens_cpu has 1 entries", "batch has 2")),
        BadInput("backend.extend_seq_lens_cpu_float_list",
                 _eager(mode="EXTEND", seq=(5, 10), ext=(2, 1), ext_cpu=[2.0, 1.0], out=3),
                 TypeError, ("extend_seq_lens_cpu must hold integers", "float64")),
        BadInput("backend.req_pool_indices_short", _eager(rows=(0,), batch=2), ValueError,
                 ("req_pool_indices has 1 entries", "batch has 2")),
        BadInput("backend.seq_lens_short", _eager(seq=(6,), seq_cpu=[6, 10]), ValueError,
                 ("seq_lens has 1 entries", "batch has 2")),
        BadInput("backend.req_pool_indices_not_a_tensor",
                 lambda: shared().init_forward_metadata(__import__("dataclasses").replace(
                     _fb(), req_pool_indices=[0, 1])),
                 TypeError, ("req_pool_indices must be a torch tensor", "list")),
        BadInput("backend.seq_lens_cpu_float",
                 lambda: shared().init_forward_metadata(__import__("dataclasses").replace(
                     _fb(), seq_lens_cpu=_t([6, 10], f32))),
                 TypeError, ("seq_lens_cpu must hold integers", "float32")),
        BadInput("backend.extend_longer_than_seq",
                 _eager(mode="EXTEND", seq=(5, 10), ext=(9, 1)), ValueError,
                 (r"extend_seq_lens_cpu\[0\] = 9", r"seq_lens_cpu\[0\] = 5")),
        BadInput("backend.extend_seq_lens_disagree",
                 _eager(mode="EXTEND", seq=(5, 10), ext=(2, 1), ext_cpu=[2, 3]), ValueError,
                 (r"extend_seq_lens\[1\] = 1", r"extend_seq_lens_cpu\[1\] = 3")),
        BadInput("backend.out_cache_loc_length", _eager(out=3), ValueError,
                 ("out_cache_loc has 3 entries", "2 query tokens")),
        BadInput("backend.replay_seq_lens_cpu_disagrees",
                 _replay(seq=(40, 40), seq_cpu=[6, 10]), ValueError,
                 (r"seq_lens\[0\] = 40", r"seq_lens_cpu\[0\] = 6")),
        BadInput("backend.replay_req_pool_index_out_of_range", _replay(rows=(0, 16)), ValueError,
                 (r"req_pool_indices\[1\] = 16", "16 rows")),
        BadInput("backend.replay_seq_len_over_max_context", _replay(seq=(300, 1)), ValueError,
                 (r"seq_lens_cpu\[0\] = 300", "max_context_len = 256")),
        BadInput("backend.replay_seq_lens_sum_disagrees", _replay(seq_sum=7), ValueError,
                 ("seq_lens_sum = 7", r"sum\(seq_lens_cpu\) = 16")),
        BadInput("backend.capture_extend", _capture_extend, ValueError,
                 ("forward_mode EXTEND", "CUDA graphs cover DECODE")),
        BadInput("backend.draft_tokens_missing",
                 _eager(mode="TARGET_VERIFY", spec=type("S", (), {"draft_token_num": 0})()),
                 ValueError, ("target_verify needs spec_info.draft_token_num", "got 0")),
        BadInput("backend.req_to_token_dtype", _bad_req_to_token, TypeError,
                 ("req_to_token must be int32", "torch.int64")),
        BadInput("backend.buckets_unsorted", _bad_buckets, ValueError,
                 ("Buckets.batch_sizes", r"\(8, 4\)")),
        BadInput("backend.metadata_launcher_off_cuda", _step_launcher_on_cpu,
                 StepLauncherUnavailable, ("the backend's device is cpu", "not CUDA")),
    ]


try:
    CASES = _cases()
except ImportError:  # torch absent: the battery's torch cases are skipped
    CASES = []
for _c in CASES:
    object.__setattr__(_c, "needs", ("torch",))
