"""AITER's persistent work planners as pure JAX functions, with NumPy oracles and validators.

* decode: `plan_mla_decode` / `plan_mla_decode_jit` (`get_mla_metadata_v1`, fast mode / v1.2),
  `DecodePlanConfig`, buffer sizes `mla_decode_plan_sizes` (`get_mla_metadata_info_v1`), input
  checks `check_decode_plan_inputs` (checkify).
* prefill: `plan_ps_prefill` / `plan_ps_prefill_jit` (`get_ps_metadata_v1`),
  `PrefillPlanConfig` (token-granular by default; the pre-fix pairing only through
  `PrefillPlanConfig.legacy_page_granular`), sizes `ps_prefill_plan_sizes`
  (`get_ps_metadata_info_v1`), `check_plan_matches_metadata`, input checks
  `check_prefill_plan_inputs` (checkify).
* `WorkPlan` (the shared output pytree) and `plan_problems` / `check_work_plan` (validators).

Eager calls of the planners check their input values; under `jit` the checkify variants are
one call away: `funcmla.checks.checked(check_decode_plan_inputs)`. docs/planners.md describes
the design.
"""

from funcmla.planners.decode import (  # noqa: F401
    check_decode_plan_inputs,
    plan_mla_decode,
    plan_mla_decode_jit,
)
from funcmla.planners.decode_config import DecodePlanConfig  # noqa: F401
from funcmla.planners.decode_sizes import DecodePlanSizes, mla_decode_plan_sizes  # noqa: F401
from funcmla.planners.plan import WORK_INFO_FIELDS, WorkPlan  # noqa: F401
from funcmla.planners.prefill import (  # noqa: F401
    PrefillPlanConfig,
    PrefillPlanSizes,
    check_plan_matches_metadata,
    check_prefill_plan_inputs,
    plan_ps_prefill,
    plan_ps_prefill_jit,
    ps_prefill_plan_sizes,
)
from funcmla.planners.validate import check_work_plan, plan_problems  # noqa: F401

__all__ = [
    "DecodePlanConfig",
    "DecodePlanSizes",
    "PrefillPlanConfig",
    "PrefillPlanSizes",
    "WORK_INFO_FIELDS",
    "WorkPlan",
    "check_decode_plan_inputs",
    "check_plan_matches_metadata",
    "check_prefill_plan_inputs",
    "check_work_plan",
    "mla_decode_plan_sizes",
    "plan_mla_decode",
    "plan_mla_decode_jit",
    "plan_ps_prefill",
    "plan_ps_prefill_jit",
    "plan_problems",
    "ps_prefill_plan_sizes",
]
