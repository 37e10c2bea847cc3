"""Your own data and your own reward: word problems from a JSONL file (with an extra
``kind`` column), scored by ``reward.py:score``, with held-out evaluation on a tenth of the
file's rows (never trained on).

    python -m rlx.main --config examples/user_reward/config.py --workdir /tmp/rlx-user-reward

The built-in model starts from random weights, so this example asks for the supervised
warm-up on the file's answers (``trainer.warmup_sft=always``); with a real checkpoint
(``--config.model.path=...``) leave it out.
"""

import pathlib

from rlx.config import (AlgorithmConfig, ArchConfig, DataConfig, MeshConfig, ModelConfig,
                        OptimizerConfig, RewardConfig, RolloutConfig, RunConfig, TrainerConfig)

HERE = pathlib.Path(__file__).parent


def get_config() -> RunConfig:
  return RunConfig(
      name="user_reward",
      model=ModelConfig(arch=ArchConfig(num_layers=2, hidden_size=128, intermediate_size=384,
                                        num_heads=4, num_kv_heads=2, head_dim=32),
                        remat="none"),
      rollout=RolloutConfig(max_slots=64, max_prompt_len=112, max_new_tokens=16, group_size=8),
      algorithm=AlgorithmConfig(name="grpo", off_policy="none"),
      optimizer=OptimizerConfig(learning_rate=3e-4),
      mesh=MeshConfig(cpu_devices=2),
      data=DataConfig(source=str(HERE / "problems.jsonl"), prompts_per_step=8,
                      eval_fraction=0.1),
      reward=RewardConfig(name=f"{HERE / 'reward.py'}:score"),
      trainer=TrainerConfig(steps=200, eval_every=50, eval_prompts=64, warmup_sft="always",
                            warmup_sft_steps=90, warmup_sft_learning_rate=3e-3),
  )
