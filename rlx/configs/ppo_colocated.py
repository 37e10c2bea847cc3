"""PPO with a critic and GAE on one colocated mesh.

The critic is the transformer plus a scalar value head with its own optimizer;
the KL to the reference policy is a per-token reward penalty.

    python -m rlx.main --config configs/ppo_colocated.py --workdir /tmp/rlx-ppo
"""

import dataclasses

from rlx.configs import base


def get_config():
  config = base.get_config()
  return dataclasses.replace(
      config,
      name="ppo_colocated",
      rollout=dataclasses.replace(config.rollout, group_size=1),
      algorithm=dataclasses.replace(
          config.algorithm, name="ppo", gamma=1.0, lam=0.95, kl_coef=0.01, kl_estimator="k1",
          kl_in_reward=True, off_policy="none"),
      data=dataclasses.replace(config.data, prompts_per_step=32),
      mesh=dataclasses.replace(config.mesh, mode="colocated"),
      # the classic PPO schedule: mini-batches of 8 prompts, 4 optimizer steps per rollout batch
      trainer=dataclasses.replace(config.trainer, mini_batches=4),
  )
