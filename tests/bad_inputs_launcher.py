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


@functools.lru_cache(maxsize=1)
def _launcher():
    """(launcher, good inputs): token CSR, 2 sequences x 16 heads, stand-in kernels."""
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
    cfg = L.DecodeLaunchConfig(**_CFG)
    lau = L.DecodeLauncher(L.decode_plan(cfg), "cpu", kernel_factory=Kernel,
                           stream_fn=lambda i: 0,
                           launch_address=ctypes.cast(nop, ctypes.c_void_p).value)
    lau._keep = nop
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(64, 576, dtype=torch.bfloat16)
    x = torch.zeros(3, dtype=torch.int32)
    y = torch.zeros(32, dtype=torch.int32)
    return lau, dict(q=q, kv=kv, x=x, y=y, out=torch.zeros(2, 16, 512, dtype=torch.bfloat16),
                     lse=torch.zeros(2, 16))


def _call(**bad):
    """The launcher called with its good inputs, `bad` replacing some (values: functions of
    the good inputs)."""
    lau, good = _launcher()
    args = dict(good)
    for name, make in bad.items():
        args[name] = make(good)
    return lau(args["q"], args["kv"], args["x"], args["y"], out=args["out"], lse=args["lse"])


def _misaligned(t):
    import torch

    flat = torch.zeros(t.numel() + 8, dtype=t.dtype)
    return flat[1:1 + t.numel()].view(t.shape)


def _err(name):
    from funcmla.interop.launcher import LauncherArgumentError, LauncherUnavailable

    return {"argument": LauncherArgumentError, "unavailable": LauncherUnavailable}[name]


def _argument_case(name, bad, match):
    return BadInput(f"launcher.{name}", lambda: _call(**bad), _err("argument"), match,
                    needs=("torch",))


def _config(**kw):
    from funcmla.interop.launcher import DecodeLaunchConfig

    return DecodeLaunchConfig(**{**_CFG, **kw})


def _plan(**kw):
    from funcmla.interop.launcher import decode_plan

    return decode_plan(_config(**kw))


def _mgpu_on_16_heads():
    from funcmla.attention.pallas import DecodeKernelConfig

    return _plan(kernel=DecodeKernelConfig(kernel="mgpu"))


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
             (r"s_q\*H = 16", r"multiple of 64")),
    BadInput("launcher.jaxlib_untested", _untested_jaxlib, _err("unavailable"),
             (r"jaxlib 0.99.1", r"0.10.2, 0.11.2")),
    BadInput("launcher.torch_decode_cpu", _torch_decode_on_cpu, _err("unavailable"),
             (r"\bq is on cpu", r"not a CUDA device"), needs=("torch",)),
    BadInput("launcher.route", _route, ValueError, (r"compile route", r"'cuda'")),
]
