"""GRPO on one colocated mesh: generate, score and learn time-sliced, always on-policy.

Group-relative advantages with std normalisation, symmetric clip 0.2, k3 KL to
the reference policy as a loss term (DeepSeekMath).

    python -m rlx.main --config configs/grpo_colocated.py --workdir /tmp/rlx-grpo
"""

import dataclasses

from rlx.configs import base


def get_config():
  config = base.get_config()
  return dataclasses.replace(
      config,
      name="grpo_colocated",
      algorithm=dataclasses.replace(
          # the preset fills the clip ranges and the aggregation, so that another
          # --config.algorithm.name gets its own
          config.algorithm, name="grpo", kl_coef=0.04, kl_estimator="k3", off_policy="none"),
      mesh=dataclasses.replace(config.mesh, mode="colocated"),
  )
