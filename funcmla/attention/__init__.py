"""Attention over the paged latent pool: the dense reference, the work-plan executor, kernels."""

from funcmla.attention.reference import mla_attention_reference  # noqa: F401
