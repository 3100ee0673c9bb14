"""Bad inputs of the torch launcher (`funcmla.interop.launcher`): a wrong tensor raises
`LauncherArgumentError` naming the argument before anything is launched; a configuration or an
environment the launcher cannot serve raises ValueError / `LauncherUnavailable` saying why.

The tensor cases run a decode launcher built on the CPU with stand-in kernels (the argument
checks are the same code on a GPU; tests/test_launcher_gpu.py repeats some on the device)."""

from __future__ import annotations

import functools
from unittest import mock

from funcmla.config import MLADims
from tests.bad_input import BadInput

SCALE = MLADims().sm_scale
_CFG = dict(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32, sm_scale=SCALE)
_FP8 = "float8_e4m3fn"


@functools.lru_cache(maxsize=2)
def _launcher(kv_dtype: str | None = None):
    """(launcher, good inputs): token CSR, 2 sequences x 16 heads, stand-in kernels; a pool of
    q's dtype, or of `kv_dtype`."""
    import ctypes

    import torch

    from funcmla.interop import _launch
    from funcmla.interop import launcher as L

    class Kernel:
        def __init__(self, call, index, arch):
            self.call, self.function = call, 0x1000
            self.grid, self.block, self.shared_mem_bytes = call.grid, (128, 1, 1), 0
            self.num_params = len(call.operands) + len(call.results)

        def info(self):
            return {"name": self.call.name}

    nop = _launch.launch_function_type(lambda *a: 0)
    cfg = L.DecodeLaunchConfig(**_CFG, kv_dtype=kv_dtype)
    lau = L.DecodeLauncher(L.decode_plan(cfg), "cpu", kernel_factory=Kernel,
                           stream_fn=lambda i: 0,
                           launch_address=ctypes.cast(nop, ctypes.c_void_p).value)
    lau._keep = nop
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(64, 576, dtype=getattr(torch, kv_dtype or "bfloat16"))
    x = torch.zeros(3, dtype=torch.int32)
    y = torch.zeros(32, dtype=torch.int32)
    return lau, dict(q=q, kv=kv, x=x, y=y, out=torch.zeros(2, 16, 512, dtype=torch.bfloat16),
                     lse=torch.zeros(2, 16))


def _call(kv_dtype=None, **bad):
    """The launcher (of a `kv_dtype` pool) called with its good inputs, `bad` replacing some or
    adding k_scale / v_scale (values: functions of the good inputs)."""
    lau, good = _launcher(kv_dtype)
    args = dict(good, k_scale=lambda g: None, v_scale=lambda g: None)
    args.update(bad)
    args = {k: v(good) if callable(v) else v for k, v in args.items()}
    return lau(args["q"], args["kv"], args["x"], args["y"], out=args["out"], lse=args["lse"],
               k_scale=args["k_scale"], v_scale=args["v_scale"])


def _misaligned(t):
    import torch

    flat = torch.zeros(t.numel() + 8, dtype=t.dtype)
    return flat[1:1 + t.numel()].view(t.shape)


def _err(name):
    from funcmla.interop.launcher import LauncherArgumentError, LauncherUnavailable

    return {"argument": LauncherArgumentError, "unavailable": LauncherUnavailable}[name]


def _argument_case(name, bad, match, kv_dtype=None):
    return BadInput(f"launcher.{name}", lambda: _call(kv_dtype, **bad), _err("argument"), match,
                    needs=("torch", "lowering"))


def _fp8_case(name, bad, match):
    return _argument_case(name, bad, match, kv_dtype=_FP8)


def _torch(fn):
    def make(good):
        import torch

        return fn(torch, good)

    return make


def _config(**kw):
    from funcmla.interop.launcher import DecodeLaunchConfig

    return DecodeLaunchConfig(**{**_CFG, **kw})


def _plan(**kw):
    from funcmla.interop.launcher import decode_plan

    return decode_plan(_config(**kw))


def _mgpu_config():
    from funcmla.attention.pallas import DecodeKernelConfig

    return DecodeKernelConfig(kernel="mgpu")


def _mgpu_on_16_heads():
    return _plan(kernel=_mgpu_config())


def _untested_jaxlib():
    from funcmla.interop import launcher as L

    with mock.patch.object(L.support, "jaxlib_version", lambda: "0.99.1"), \
            mock.patch.dict("os.environ", {"FUNCMLA_LAUNCHER_ANY_JAXLIB": "0"}):
        return L.decode_plan(_config(kv_capacity=48))


def _wrong_device():
    import torch

    from funcmla.interop.launcher import TensorSpec

    return TensorSpec("q", torch.bfloat16, [(2, 3)], device_index=0).pointer(
        torch.zeros(2, 3, dtype=torch.bfloat16))


def _torch_decode_on_cpu():
    import torch

    from funcmla.interop.launcher import torch_decode

    return torch_decode(torch.zeros(2, 16, 576, dtype=torch.bfloat16),
                        torch.zeros(64, 576, dtype=torch.bfloat16),
                        torch.zeros(3, dtype=torch.int32), torch.zeros(32, dtype=torch.int32),
                        sm_scale=SCALE)


def _route():
    from funcmla.interop.launcher import kernel_route

    return kernel_route("cuda")


def _torch_decode_pool(dtype_name: str):
    import torch

    from funcmla.interop.launcher import torch_decode

    pool = torch.zeros(64, 576, dtype=torch.float8_e4m3fn).view(getattr(torch, dtype_name))
    return torch_decode(torch.zeros(2, 16, 576, dtype=torch.bfloat16), pool,
                        torch.zeros(3, dtype=torch.int32), torch.zeros(32, dtype=torch.int32),
                        sm_scale=SCALE)


def _new_float_in_capture():
    import torch

    from funcmla.interop.launcher import scales

    with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
        return scales.FloatScales(torch.device("cuda", 0)).tensor("k_scale", 0.75)


def _float_scales_full():
    from funcmla.interop.launcher import scales

    with mock.patch.object(scales, "MAX_FLOAT_SCALES", 2):
        kept = scales.FloatScales("cpu")
        kept.tensor("k_scale", 2.0)
        kept.tensor("k_scale", 2.5)
        return kept.tensor("v_scale", 3.0)


CASES: list[BadInput] = [
    _argument_case("q_dtype", {"q": lambda g: g["q"].float()}, (r"\bq\b", r"float32")),
    _argument_case("q_shape", {"q": lambda g: g["q"][:1]},
                   (r"\bq has shape \[1, 16, 576\]", r"takes \[2, 16, 576\]")),
    _argument_case("q_strides", {"q": lambda g: g["q"].transpose(0, 1).contiguous()
                                 .transpose(0, 1)}, (r"\bq must be contiguous", r"strides")),
    _argument_case("kv_pool_alignment", {"kv": lambda g: _misaligned(g["kv"])},
                   (r"kv_pool data pointer", r"not 32-byte aligned")),
    _argument_case("kv_pool_rows", {"kv": lambda g: g["kv"][:-1]},
                   (r"kv_pool has shape \[63, 576\]", r"\[64, 576\]")),
    _argument_case("kv_indices_dtype", {"y": lambda g: g["y"].long()},
                   (r"kv_indices must be torch.int32", r"torch.int64")),
    _argument_case("kv_indptr_shape", {"x": lambda g: g["x"][:2]},
                   (r"kv_indptr has shape \[2\]", r"takes \[3\]")),
    _argument_case("out_dtype", {"out": lambda g: g["out"].float()},
                   (r"\bout must be torch.bfloat16", r"torch.float32")),
    _argument_case("lse_shape", {"lse": lambda g: g["lse"][:1]},
                   (r"lse has shape \[1, 16\]", r"\[2, 16\]")),
    _argument_case("not_a_tensor", {"q": lambda g: [0.0]},
                   (r"\bq must be a torch.Tensor", r"got list")),
    BadInput("launcher.device", _wrong_device, _err("argument"),
             (r"\bq is on cpu", r"built for cuda:0"), needs=("torch",)),
    BadInput("launcher.config_page_size", lambda: _config(page_size=3), ValueError,
             (r"page_size", r"power of two, got 3")),
    BadInput("launcher.config_num_seqs", lambda: _config(num_seqs=0), ValueError,
             (r"num_seqs", r"positive int, got 0")),
    BadInput("launcher.mgpu_shape", _mgpu_on_16_heads, _err("unavailable"),
             (r"s_q\*H = 16", r"multiple of 64"), needs=("torch", "launcher")),
    BadInput("launcher.jaxlib_untested", _untested_jaxlib, _err("unavailable"),
             (r"jaxlib 0.99.1", r"0.10.2, 0.11.2")),
    BadInput("launcher.torch_decode_cpu", _torch_decode_on_cpu, _err("unavailable"),
             (r"\bq is on cpu", r"not a CUDA device"), needs=("torch",)),
    BadInput("launcher.route", _route, ValueError, (r"compile route", r"'cuda'")),
    BadInput("launcher.config_kv_dtype", lambda: _config(kv_dtype="float8_e5m2"), ValueError,
             (r"DecodeLaunchConfig.kv_dtype", r"got 'float8_e5m2'")),
    _fp8_case("fp8_pool_dtype", {"kv": _torch(lambda torch, g: g["kv"].to(torch.bfloat16))},
              (r"kv_pool must be torch.float8_e4m3fn", r"got torch.bfloat16")),
    _fp8_case("k_scale_dtype", {"k_scale": _torch(lambda torch, g: torch.ones(1).double())},
              (r"k_scale must be torch.float32", r"got torch.float64")),
    _fp8_case("v_scale_shape", {"v_scale": _torch(lambda torch, g: torch.ones(2))},
              (r"v_scale has shape \[2\]", r"takes \[\] or \[1\]")),
    _fp8_case("k_scale_alignment", {"k_scale": _torch(lambda torch, g: torch.ones(9)[1:2])},
              (r"k_scale data pointer", r"not 32-byte aligned")),
    _fp8_case("k_scale_value", {"k_scale": -1.0},
              (r"k_scale=\[-1.0\]", r"positive finite float")),
    _fp8_case("v_scale_type", {"v_scale": "0.5"},
              (r"v_scale must be a float or a float32 torch tensor", r"got str")),
    _argument_case("scale_on_bf16_pool", {"k_scale": 0.5},
                   (r"k_scale applies to an fp8 kv_pool", r"pool is bfloat16")),
    BadInput("launcher.k_scale_new_in_capture", _new_float_in_capture, _err("argument"),
             (r"k_scale=0.75", r"during a CUDA graph capture"), needs=("torch",)),
    BadInput("launcher.float_scales_full", _float_scales_full, _err("argument"),
             (r"v_scale=3.0", r"2 distinct float scales are already kept"), needs=("torch",)),
    BadInput("launcher.torch_decode_pool_e5m2", lambda: _torch_decode_pool("float8_e5m2"),
             _err("unavailable"), (r"kv_pool is torch.float8_e5m2",
                                   r"float8_e4m3fn fp8 pools only"), needs=("torch",)),
    BadInput("launcher.torch_decode_pool_uint8", lambda: _torch_decode_pool("uint8"),
             _err("unavailable"), (r"kv_pool is torch.uint8",
                                   r"view\(torch.float8_e4m3fn\)"), needs=("torch",)),
]
