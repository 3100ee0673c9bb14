"""Bad inputs of the torch extend launcher (`funcmla.interop.launcher.extend`): a wrong tensor,
a batch or a token count over the launcher's capacities, the wrong index form or a step of
another launcher raises `LauncherArgumentError` naming the argument before anything runs; a bad
configuration raises ValueError naming the field.

The call cases run an `ExtendLauncher` built on the CPU over a stand-in decode that records its
calls in DECODE_CALLS (tests/test_launcher_extend.py checks that none ran)."""

from __future__ import annotations

import functools

from tests.bad_input import BadInput

DECODE_CALLS: list = []


def _config(**kw):
    from funcmla.interop.launcher.extend import ExtendLaunchConfig
    from tests.launcher_helpers import SCALE

    base = dict(num_heads=16, q_capacity=24, batch=4, pool_rows=512, kv_capacity=200,
                sm_scale=SCALE)
    return ExtendLaunchConfig(**{**base, **kw})


class _Decode:
    """Stands in for a LensDecodeLauncher: its configuration, the CPU, a call log."""

    def __init__(self, config):
        import torch

        self.config, self.device, self.device_index = config, torch.device("cpu"), -1

    def __call__(self, *args, **kwargs):
        DECODE_CALLS.append(args)
        raise AssertionError("a bad input reached the decode launch")

    def check_pool(self, kv_pool, k_scale=None, v_scale=None):
        """The real launcher's pool checks are its own battery's (`launcher.*`)."""


@functools.lru_cache(maxsize=2)
def _launcher(page_size: int = 1):
    """(launcher, good inputs): 2 requests of 3 / 2 queries over 4 / 5 keys (a token CSR, or a
    page table of 16-token pages)."""
    import torch

    from funcmla.interop.launcher.extend import ExtendLauncher

    cfg = _config() if page_size == 1 else _config(page_size=16, kv_capacity=4 * 4)
    i32 = torch.int32
    good = dict(qo=torch.tensor([0, 3, 5], dtype=i32), q=torch.zeros(5, 16, 576,
                                                                     dtype=torch.bfloat16))
    if page_size == 1:
        good.update(kv_indptr=torch.tensor([0, 4, 9], dtype=i32),
                    kv_indices=torch.zeros(cfg.kv_capacity, dtype=i32))
    else:
        good.update(page_table=torch.zeros(2, 4, dtype=i32),
                    lengths=torch.tensor([4, 5], dtype=i32))
    return ExtendLauncher(cfg, _Decode(cfg.decode_config)), good


_INDEX = ("kv_indptr", "kv_indices", "page_table", "lengths")


def _layout(page_size=1, num_q=5, **bad):
    lau, good = _launcher(page_size)
    args = {**good, **{name: fn(good) for name, fn in bad.items()}}
    return lau.layout(args["qo"], num_q=num_q, **{k: args[k] for k in _INDEX if k in args})


def _call(**bad):
    lau, good = _launcher()
    step = lau.layout(good["qo"], good["kv_indptr"], good["kv_indices"], num_q=5)
    args = {"q": good["q"], "step": step, "out": None,
            **{name: fn(good, step) for name, fn in bad.items()}}
    return lau(args["q"], None, args["step"], out=args["out"])


def _empty_call(**bad):
    """A step with no query rows: nothing to launch, the tensors still checked."""
    lau, good = _launcher()
    step = lau.layout(good["qo"] * 0, good["kv_indptr"], good["kv_indices"], num_q=0)
    args = {"q": good["q"][:0], "out": None, **{name: fn(good, step) for name, fn in bad.items()}}
    return lau(args["q"], None, step, out=args["out"])


def _err():
    from funcmla.interop.launcher import LauncherArgumentError

    return LauncherArgumentError


def _torch(fn):
    def make(*args):
        import torch

        return fn(torch, *args)

    return make


def _layout_case(name, match, page_size=1, num_q=5, **bad):
    return BadInput(f"launcher_extend.layout_{name}",
                    lambda: _layout(page_size, num_q, **bad), _err(), match, needs=("torch",))


def _call_case(name, match, **bad):
    return BadInput(f"launcher_extend.call_{name}", lambda: _call(**bad), _err(), match,
                    needs=("torch",))


def _config_case(name, match, **kw):
    return BadInput(f"launcher_extend.config_{name}", lambda: _config(**kw), ValueError, match,
                    needs=("torch",))


CASES: list[BadInput] = [
    _layout_case("indptr_dtype", (r"qo_indptr must be torch.int32", r"got torch.int64"),
                 qo=lambda g: g["qo"].long()),
    _layout_case("batch", (r"qo_indptr has 6 entries", r"B <= batch = 4"),
                 qo=_torch(lambda torch, g: torch.zeros(6, dtype=torch.int32))),
    _layout_case("num_q", (r"num_q = 25", r"\[0, 24\] \(the launcher's q_capacity\)"),
                 num_q=25),
    _layout_case("kv_indices_shape", (r"kv_indices has shape \[7\]", r"takes \[200\]"),
                 kv_indices=lambda g: g["kv_indices"][:7]),
    _layout_case("kv_indptr_shape", (r"kv_indptr has shape \[2\]", r"takes \[3\]"),
                 kv_indptr=lambda g: g["kv_indptr"][:2]),
    _layout_case("index_form", (r"page_size-1 launcher takes kv_indptr and kv_indices",
                                r"not page_table / lengths"),
                 page_table=lambda g: g["kv_indices"]),
    _layout_case("page_table_shape", (r"page_table has shape \[2, 3\]", r"\[B, 4\] for B = 2"),
                 page_size=16, page_table=lambda g: g["page_table"][:, :3]),
    _layout_case("lengths_dtype", (r"lengths must be torch.int32", r"got torch.int64"),
                 page_size=16, lengths=lambda g: g["lengths"].long()),
    _layout_case("not_a_tensor", (r"kv_indptr must be a torch.Tensor", r"got ndarray"),
                 kv_indptr=lambda g: g["kv_indptr"].numpy()),
    _call_case("q_shape", (r"\bq has shape \[4, 16, 576\]", r"\[5, 16, 576\]"),
               q=lambda g, s: g["q"][:4]),
    _call_case("q_dtype", (r"\bq must be torch.bfloat16", r"got torch.float32"),
               q=lambda g, s: g["q"].float()),
    _call_case("step", (r"step must be a layout of this launcher", r"got object"),
               step=lambda g, s: object()),
    _call_case("out_shape", (r"\bout must be contiguous of shape", r"got \[5, 16, 500\]"),
               out=_torch(lambda torch, g, s: torch.zeros(5, 16, 500, dtype=torch.bfloat16))),
    BadInput("launcher_extend.empty_call_out_shape",
             lambda: _empty_call(out=_torch(lambda torch, g, s: torch.zeros(
                 1, 16, 512, dtype=torch.bfloat16))), _err(),
             (r"\bout must be contiguous of shape \(0, 16, 512\)", r"got \[1, 16, 512\]"),
             needs=("torch",)),
    _config_case("q_capacity", (r"ExtendLaunchConfig.q_capacity must be an int >= 1",
                                r"got 0"), q_capacity=0),
    _config_case("page_table_capacity", (r"ExtendLaunchConfig.kv_capacity=102",
                                         r"batch \* max_pages \(batch=4\)"),
                 page_size=16, kv_capacity=102),
    _config_case("max_kv_len_with_pages", (r"ExtendLaunchConfig.max_kv_len is implied",
                                           r"max_pages \* page_size"),
                 page_size=16, kv_capacity=16, max_kv_len=64),
    _config_case("causal", (r"ExtendLaunchConfig.causal must be a bool", r"got 1"), causal=1),
]
