"""rlx: reinforcement learning for large language models in JAX."""

__version__ = "0.1.0"
