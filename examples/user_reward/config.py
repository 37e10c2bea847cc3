"""Your own data and your own reward: word problems from a JSONL file (with an extra
``kind`` column), scored by ``reward.py:score``, with held-out evaluation on a tenth of the
file's rows (never trained on).

    python -m rlx.main --config examples/user_reward/config.py --workdir /tmp/rlx-user-reward

The built-in model starts from random weights, so this example asks for the supervised
warm-up on the file's answers (``trainer.warmup_sft=always``); with a real checkpoint
(``--config.model.path=...``) leave it out.
"""

import dataclasses
import pathlib

from rlx.configs import base

HERE = pathlib.Path(__file__).parent


def get_config():
  config = base.get_config()
  return dataclasses.replace(
      config,
      name="user_reward",
      rollout=dataclasses.replace(config.rollout, max_prompt_len=112),
      data=dataclasses.replace(config.data, source=str(HERE / "problems.jsonl"),
                               eval_fraction=0.1),
      reward=dataclasses.replace(config.reward, name=f"{HERE / 'reward.py'}:score"),
      trainer=dataclasses.replace(config.trainer, steps=200, eval_every=50, eval_prompts=64,
                                  warmup_sft="always"),
  )
