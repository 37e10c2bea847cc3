"""Base config: the built-in tiny model on the synthetic arithmetic task, on CPU or any mesh.

Every other config file derives from this one with ``dataclasses.replace``.

    python -m rlx.main --config configs/base.py --workdir /tmp/rlx-base
"""

from rlx.config import RunConfig


def get_config() -> RunConfig:
  return RunConfig(name="base")
