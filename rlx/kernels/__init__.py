"""Fused log-prob / entropy of the policy: reference, XLA chunked and Pallas (GPU, TPU)."""

from rlx.kernels.fused_logprobs import (choose_impl, compiling_for, fused_logprobs,
                                        reference_logprobs, target_platform, xla_logprobs)
from rlx.kernels.pallas_logprobs import pallas_logprobs

__all__ = ["choose_impl", "compiling_for", "fused_logprobs", "pallas_logprobs",
           "reference_logprobs", "target_platform", "xla_logprobs"]
