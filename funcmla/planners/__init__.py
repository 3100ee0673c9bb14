"""AITER's persistent work planners as pure JAX functions, with NumPy oracles and validators.

* decode: `plan_mla_decode` (`get_mla_metadata_v1`, fast mode / v1.2), `DecodePlanConfig`,
  buffer sizes `mla_decode_plan_sizes` (`get_mla_metadata_info_v1`).
* prefill: `plan_ps_prefill` (`get_ps_metadata_v1`), `PrefillPlanConfig` (token-granular by
  default; the seed's pairing only through `PrefillPlanConfig.legacy_page_granular`), sizes
  `ps_prefill_plan_sizes` (`get_ps_metadata_info_v1`), `check_plan_matches_metadata`.
* `WorkPlan` (the shared output pytree) and `plan_problems` / `check_work_plan` (validators).
"""

from funcmla.planners.decode import DecodePlanConfig, plan_mla_decode  # noqa: F401
from funcmla.planners.decode_sizes import mla_decode_plan_sizes  # noqa: F401
from funcmla.planners.plan import WORK_INFO_FIELDS, WorkPlan  # noqa: F401
from funcmla.planners.prefill import (  # noqa: F401
    PrefillPlanConfig,
    check_plan_matches_metadata,
    plan_ps_prefill,
    ps_prefill_plan_sizes,
)
from funcmla.planners.validate import check_work_plan, plan_problems  # noqa: F401
