"""funcmla's Pallas kernels as torch ops: compiled once, launched on torch's current stream.

The launcher runs the kernels `mla_decode` runs for the same shapes (its auto dispatch: the Mosaic
GPU kernel where it applies, else the Triton-lowered one, plus the merge kernel when the KV is
split), on `torch.cuda.current_stream()`, with one foreign call per step, so a torch CUDA graph
captures it. Design, invariants, knobs and H200 numbers: docs/torch_launcher.md.

Modules, in the order a launcher is built:
  extract      the JAX path lowered for CUDA (no GPU): `TritonCall` / `MosaicCall` per kernel,
               each operand traced back to the input whose bytes it is.
  plan         `DecodeLaunchConfig` (static shapes, the pool's dtype) -> `DecodePlan` (the
               kernels, checked against the buffers the launcher wires; `kernel_reason` says
               why Triton where it is).
  compile      Triton kernels -> cubin: XLA's own (route "xla") or the `triton` package's.
  mosaic       Mosaic GPU kernels -> jaxlib's compiled module and host launch function.
  load         cubins into the device's primary context.
  checks       `TensorSpec`: what each tensor must be.
  scales       an fp8 pool's k_scale / v_scale: tensors by pointer, floats as device copies.
  decode       `DecodeLauncher` / `PagedDecodeLauncher` / `LensDecodeLauncher`: the launch
               program and its checks.
  extend       `ExtendLauncher`: `mla_extend` (decode over query chunks) on torch tensors for
               every batch within a configuration's capacities.
  prefill      `PrefillLauncher` / `torch_mha_prefill`: `mha_prefill`'s Mosaic GPU kernel for
               every batch within a configuration's capacities (prefill_layout: its
               index arrays in torch ops).
  torch_entry  `torch_decode`, `torch_extend` and the torch ops (`torch.ops.funcmla.*`).
  segments     `funcmla.segments.segment_positions` in torch ops (the per-step layouts).
  support      the jaxlib versions the extraction was tested on.
  device       whether a launcher can run here, the CUDA device index, torch's raw stream.
"""

from funcmla.interop.launcher.checks import TensorSpec
from funcmla.interop.launcher.compile import (
    CompiledImage,
    compile_call,
    compile_plan,
    kernel_route,
    ptx_entry_params,
)
from funcmla.interop.launcher.decode import (
    DecodeLauncher,
    LensDecodeLauncher,
    PagedDecodeLauncher,
    decode_launcher,
)
from funcmla.interop.launcher.device import launcher_unavailable_reason
from funcmla.interop.launcher.errors import LauncherArgumentError, LauncherUnavailable
from funcmla.interop.launcher.extract import (
    MosaicCall,
    TritonCall,
    extract_kernel_calls,
    extract_triton_calls,
    parse_kernel_call_proto,
    ttir_divisibility,
    ttir_text,
)
from funcmla.interop.launcher.extend import (
    ExtendLaunchConfig,
    ExtendLauncher,
    ExtendStep,
    extend_launcher,
)
from funcmla.interop.launcher.load import LoadedKernel
from funcmla.interop.launcher.mosaic import MosaicKernel
from funcmla.interop.launcher.plan import DecodeLaunchConfig, DecodePlan, decode_plan
from funcmla.interop.launcher.prefill import (
    PrefillLaunchConfig,
    PrefillLauncher,
    PrefillPlan,
    PrefillStep,
    prefill_batch_capacity,
    prefill_capacity,
    prefill_launcher,
    prefill_plan,
    torch_mha_prefill,
)
from funcmla.interop.launcher.scales import FloatScales, ScaleOperands
from funcmla.interop.launcher.support import TESTED_JAXLIB, jaxlib_unsupported_reason
from funcmla.interop.launcher.torch_entry import (
    register_torch_ops,
    torch_decode,
    torch_decode_launcher,
    torch_decode_unsupported_reason,
    torch_extend,
    torch_extend_config,
    torch_extend_launcher,
    torch_extend_unsupported_reason,
)

__all__ = [
    "LauncherArgumentError",
    "LauncherUnavailable",
    "TritonCall",
    "MosaicCall",
    "extract_triton_calls",
    "extract_kernel_calls",
    "parse_kernel_call_proto",
    "ptx_entry_params",
    "TensorSpec",
    "LoadedKernel",
    "MosaicKernel",
    "CompiledImage",
    "DecodeLaunchConfig",
    "DecodePlan",
    "decode_plan",
    "FloatScales",
    "ScaleOperands",
    "compile_plan",
    "kernel_route",
    "DecodeLauncher",
    "PagedDecodeLauncher",
    "LensDecodeLauncher",
    "decode_launcher",
    "ExtendLaunchConfig",
    "ExtendLauncher",
    "ExtendStep",
    "extend_launcher",
    "launcher_unavailable_reason",
    "compile_call",
    "ttir_text",
    "ttir_divisibility",
    "torch_decode",
    "torch_decode_launcher",
    "torch_decode_unsupported_reason",
    "torch_extend",
    "torch_extend_config",
    "torch_extend_launcher",
    "torch_extend_unsupported_reason",
    "register_torch_ops",
    "PrefillLaunchConfig",
    "PrefillLauncher",
    "PrefillPlan",
    "PrefillStep",
    "prefill_plan",
    "prefill_launcher",
    "prefill_capacity",
    "prefill_batch_capacity",
    "torch_mha_prefill",
    "TESTED_JAXLIB",
    "jaxlib_unsupported_reason",
]
