"""Fused log-prob / entropy of the policy: reference, XLA chunked, (Pallas) implementations."""

from rlx.kernels.fused_logprobs import fused_logprobs, reference_logprobs, xla_logprobs

__all__ = ["fused_logprobs", "reference_logprobs", "xla_logprobs"]
