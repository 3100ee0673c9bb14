"""Bad inputs of the torch prefill launcher (`funcmla.interop.launcher.prefill`): a wrong tensor,
a batch over the launcher's capacities or a step of other shapes raises `LauncherArgumentError`
naming the argument before anything runs; a bad configuration raises ValueError naming the field.

The call cases run a launcher built on the CPU with a stand-in kernel whose host function
records its calls in HOST_CALLS (tests/test_launcher_prefill.py checks that none ran)."""

from __future__ import annotations

import functools

from tests.bad_input import BadInput

HOST_CALLS: list = []


@functools.lru_cache(maxsize=1)
def _launcher():
    """(launcher, good inputs): `cpu_launch_config`'s launcher; 2 requests of 8 / 8 queries over
    8 / 16 keys."""
    import ctypes

    import torch

    from funcmla.interop import _launch
    from funcmla.interop.launcher import PrefillLauncher, prefill_plan
    from tests.launcher_helpers import cpu_launch_config

    class Kernel:
        def __init__(self, call, index):
            self.call, self.function, self.host_abi = call, 0x1000, _launch.HOST_ABI_DIRECT
            self.num_params = len(call.operands) + len(call.results)
            self.grid, self.block, self.shared_mem_bytes = (0, 0, 0), (0, 0, 0), 0
            self._cb = _launch._HOST_FN[self.host_abi](lambda *a: HOST_CALLS.append(a))
            self.host = ctypes.cast(self._cb, ctypes.c_void_p).value

        def info(self):
            return {"name": self.call.name}

    nop = _launch.launch_function_type(lambda *a: 0)
    lau = PrefillLauncher(prefill_plan(cpu_launch_config()), "cpu",
                          kernel_factory=Kernel, stream_fn=lambda i: 0,
                          launch_address=ctypes.cast(nop, ctypes.c_void_p).value, native=False)
    lau._keep = nop
    bf = torch.bfloat16
    good = dict(q=torch.zeros(19, 2, 192, dtype=bf), k=torch.zeros(29, 2, 192, dtype=bf),
                v=torch.zeros(29, 2, 128, dtype=bf),
                qo=torch.tensor([0, 8, 16], dtype=torch.int32),
                kv=torch.tensor([0, 8, 24], dtype=torch.int32), out=None, step=None)
    return lau, good


def _call(**bad):
    """The launcher called with its good inputs, `bad` replacing some (values: functions of
    the good inputs and the launcher)."""
    lau, good = _launcher()
    both = bad.pop("with_csrs", False)
    args = {**good, **{name: fn(good, lau) for name, fn in bad.items()}}
    if "step" in bad and not both:  # a step replaces the CSRs
        args["qo"] = args["kv"] = None
    return lau(args["q"], args["k"], args["v"], args["qo"], args["kv"], step=args["step"],
               out=args["out"], kv_laid_out=args.get("kv_laid_out", False),
               **{n: args.get(n) for n in ("q_scale", "k_scale", "v_scale")})


def _torch(fn):
    def make(good, lau):
        import torch

        return fn(torch, good)

    return make


def _err():
    from funcmla.interop.launcher import LauncherArgumentError

    return LauncherArgumentError


def _case(name, bad, match):
    return BadInput(f"launcher_prefill.call_{name}", lambda: _call(**bad), _err(), match,
                    needs=("torch", "launcher"))


def _config(**kw):
    from tests.launcher_helpers import cpu_launch_config

    return cpu_launch_config(**kw)


def _default_kernel():
    from funcmla.attention.pallas import MgpuPrefillConfig

    return MgpuPrefillConfig()


def _torch_mha_prefill(**kw):
    """`torch_mha_prefill` on good CPU inputs with `kw`: its config checks come before any
    launcher is built."""
    import torch

    from funcmla.interop.launcher import torch_mha_prefill

    bf = torch.bfloat16
    return torch_mha_prefill(torch.zeros(16, 2, 192, dtype=bf), torch.zeros(16, 2, 192, dtype=bf),
                             torch.zeros(16, 2, 128, dtype=bf),
                             torch.tensor([0, 8, 16], dtype=torch.int32),
                             torch.tensor([0, 8, 16], dtype=torch.int32), sm_scale=0.125, **kw)


_BOTH = {"step": lambda g, lau: lau.layout(g["qo"], g["kv"], 19, 29), "with_csrs": True}


def _other_step(good, lau):
    return lau.layout(good["qo"], good["kv"], 18, 29)


CASES: list[BadInput] = [
    _case("q_dtype", {"q": lambda g, _: g["q"].float()},
          (r"\bq must be torch.bfloat16", r"got torch.float32")),
    _case("k_heads", {"k": lambda g, _: g["k"][:, :1]},
          (r"\bk has shape \[29, 1, 192\]", r"takes \[T, 2, 192\]")),
    _case("v_head_dim", {"v": _torch(lambda torch, g: torch.zeros(29, 2, 192,
                                                                  dtype=torch.bfloat16))},
          (r"\bv has shape \[29, 2, 192\]", r"takes \[T, 2, 128\]")),
    _case("kv_rows", {"v": lambda g, _: g["v"][:-1]}, (r"\bk has 29 rows and v 28",)),
    _case("q_capacity", {"q": _torch(lambda torch, g: torch.zeros(257, 2, 192,
                                                                  dtype=torch.bfloat16))},
          (r"num_q \(q rows\) = 257", r"\[0, 256\]")),
    _case("batch", {"qo": _torch(lambda torch, g: torch.arange(7, dtype=torch.int32)),
                    "kv": _torch(lambda torch, g: torch.arange(7, dtype=torch.int32))},
          (r"qo_indptr has shape \[7\]", r"batch = 5")),
    _case("indptr_dtype", {"kv": lambda g, _: g["kv"].long()},
          (r"kv_indptr must be torch.int32", r"got torch.int64")),
    _case("indptr_shapes", {"kv": lambda g, _: g["kv"][:2]},
          (r"qo_indptr \[3\] and kv_indptr \[2\]", r"\[B \+ 1\] for one B")),
    _case("not_a_tensor", {"qo": lambda g, _: g["qo"].numpy()},
          (r"qo_indptr must be a torch.Tensor", r"got ndarray")),
    _case("out_shape", {"out": _torch(lambda torch, g: torch.zeros(18, 2, 128,
                                                                   dtype=torch.bfloat16))},
          (r"\bout must be a contiguous \[19, 2, 128\]", r"got \[18, 2, 128\]")),
    _case("step_shapes", {"step": _other_step},
          (r"step must be this launcher's layout for 19 q rows and 29 k / v rows",
           r"a layout for 18 / 29 rows")),
    _case("step_and_indptrs", _BOTH,
          (r"or step=, not both",)),
    _case("fp8_format", {"k": _torch(lambda torch, g: g["k"].to(torch.float8_e5m2))},
          (r"\bk must be torch.bfloat16 or torch.float8_e4m3fn or torch.float8_e4m3fnuz",
           r"got torch.float8_e5m2")),
    _case("scale_on_bf16", {"q_scale": lambda g, _: 0.5},
          (r"q_scale applies to an fp8 operand", r"q is torch.bfloat16")),
    _case("scale_value", {"k": _torch(lambda torch, g: g["k"].to(torch.float8_e4m3fn)),
                          "k_scale": lambda g, _: 0.0},
          (r"k_scale=0.0", r"positive finite float")),
    _case("scale_shape", {"v": _torch(lambda torch, g: g["v"].to(torch.float8_e4m3fn)),
                          "v_scale": _torch(lambda torch, g: torch.ones(2))},
          (r"v_scale has shape \[2\]", r"\[\] or \[1\]")),
    _case("scale_type", {"q": _torch(lambda torch, g: g["q"].to(torch.float8_e4m3fn)),
                         "q_scale": lambda g, _: "1.0"},
          (r"q_scale must be a float or a float32 torch tensor", r"got str")),
    _case("no_indptrs", {"qo": lambda g, _: None},
          (r"pass qo_indptr and kv_indptr", r"or step=")),
    _case("laid_out_without_step", {"kv_laid_out": lambda g, _: True},
          (r"kv_laid_out=True needs step=",)),
    _case("laid_out_rows", {"kv_laid_out": lambda g, _: True,
                            "step": lambda g, lau: lau.layout(g["qo"], g["kv"], 19, 29)},
          (r"k / v laid out have 29 rows", r"geometry.kv_rows = \d+")),
    BadInput("launcher_prefill.kernel_and_max_kv_len", lambda: _torch_mha_prefill(
        kernel=_default_kernel(), max_kv_len=16), _err(), (r"max_kv_len picks the kernel config",
                                 r"one of kernel and max_kv_len"), needs=("torch",)),
    BadInput("launcher_prefill.max_kv_len", lambda: _torch_mha_prefill(max_kv_len=-1),
             ValueError, (r"max_kv_len must be an int >= 0", r"got -1"), needs=("torch",)),
    BadInput("launcher_prefill.config_heads", lambda: _config(num_heads=0), ValueError,
             (r"PrefillLaunchConfig.num_heads", r"int >= 1, got 0")),
    BadInput("launcher_prefill.config_sm_scale", lambda: _config(sm_scale=-1.0), ValueError,
             (r"PrefillLaunchConfig.sm_scale=-1.0", r"positive finite")),
    BadInput("launcher_prefill.config_kernel", lambda: _config(kernel="fast"), ValueError,
             (r"PrefillLaunchConfig.kernel", r"got str")),
]
