"""Static configuration: MLA dimensions and device profiles.

Everything here is a frozen dataclass, so it is hashable and can be passed to `jax.jit` as a
static argument (it becomes part of the compilation cache key).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "MLADims",
    "deepseek_v3",
    "deepseek_v3_sm_scale",
    "DeviceProfile",
    "MI300X",
    "MI355X",
    "H200",
    "DEVICE_PROFILES",
    "custom_device",
    "get_device_profile",
]


def deepseek_v3_sm_scale(
    qk_head_dim: int = 192, rope_factor: float = 40.0, mscale_all_dim: float = 1.0
) -> float:
    """DeepSeek-V3's softmax scale: `qk_head_dim**-0.5 * mscale**2` (yarn rope scaling).

    `mscale = 0.1 * mscale_all_dim * ln(rope_factor) + 1`. The absorbed 576-wide MLA path uses
    the same scale as the 192-wide MHA path, not 1/sqrt(576).
    """
    mscale = 0.1 * mscale_all_dim * math.log(rope_factor) + 1.0
    return qk_head_dim**-0.5 * mscale * mscale


@dataclasses.dataclass(frozen=True)
class MLADims:
    """Dimensions of absorbed MLA attention over the latent KV cache.

    A cache row is `kv_lora_rank + qk_rope_head_dim` wide (576 for DeepSeek-V3); V is its first
    `v_head_dim` columns (512). Queries are `[tokens, num_heads, head_dim_qk]`.
    """

    num_heads: int = 16
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    v_head_dim: int = 512
    sm_scale: float = dataclasses.field(default_factory=deepseek_v3_sm_scale)

    def __post_init__(self):
        for name in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLADims.{name} must be a positive int, got {value!r}")
        if self.v_head_dim > self.head_dim_qk:
            raise ValueError(
                f"MLADims.v_head_dim={self.v_head_dim} exceeds the cache row width "
                f"{self.head_dim_qk} (v is a prefix of the latent row)"
            )
        if not (self.sm_scale > 0 and math.isfinite(self.sm_scale)):
            raise ValueError(f"MLADims.sm_scale must be positive and finite, got {self.sm_scale}")

    @property
    def head_dim_qk(self) -> int:
        """Width of a query / cache row: kv_lora_rank + qk_rope_head_dim (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def deepseek_v3(num_heads: int = 128) -> MLADims:
    """DeepSeek-V3 absorbed-MLA dims; `num_heads` is per rank (128 / tp, e.g. 16 at TP8)."""
    return MLADims(num_heads=num_heads)


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What the work planners need to know of a device.

    `num_cu` is the number of compute units (AMD CUs / NVIDIA SMs) the persistent planners spread
    work over; `arch` is "gfx942", "gfx950" (AMD) or "sm90" (NVIDIA Hopper), which selects AITER's
    arch-dependent tile rules.
    """

    name: str
    arch: str
    num_cu: int

    def __post_init__(self):
        if not isinstance(self.num_cu, int) or self.num_cu <= 0:
            raise ValueError(f"DeviceProfile.num_cu must be a positive int, got {self.num_cu!r}")
        if self.arch not in ("gfx942", "gfx950", "sm90"):
            raise ValueError(
                f"DeviceProfile.arch must be 'gfx942', 'gfx950' or 'sm90', got {self.arch!r}"
            )

    @property
    def vendor(self) -> str:
        return "amd" if self.arch.startswith("gfx") else "nvidia"


MI300X = DeviceProfile("MI300X", "gfx942", 304)
MI355X = DeviceProfile("MI355X", "gfx950", 256)
H200 = DeviceProfile("H200", "sm90", 132)

DEVICE_PROFILES: dict[str, DeviceProfile] = {p.name.lower(): p for p in (MI300X, MI355X, H200)}


def custom_device(num_cu: int, arch: str = "gfx942", name: str = "custom") -> DeviceProfile:
    """A device profile with an arbitrary CU count (e.g. an MI300X partition, or a test grid)."""
    return DeviceProfile(name, arch, num_cu)


def get_device_profile(name: str) -> DeviceProfile:
    """Look a profile up by name ("mi300x", "mi355x", "h200"; case-insensitive)."""
    try:
        return DEVICE_PROFILES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown device profile {name!r}; known: {sorted(DEVICE_PROFILES)} "
            "(or build one with funcmla.config.custom_device)"
        ) from None
