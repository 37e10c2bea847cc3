"""GRPO on grade-school math with Qwen3-1.7B, thinking on (the default) or off.

Data as in ``qwen25_math_grpo.py``. Thinking on: long reasoning before the answer, so 4096
new tokens; off (``--config.data.chat_template_kwargs='{"enable_thinking": false}'``, and
``--config.rollout.max_new_tokens=1024``): the template closes the thinking block first.

    huggingface-cli download Qwen/Qwen3-1.7B --local-dir models/Qwen3-1.7B
    python -m rlx.main --config configs/qwen3_math.py --workdir runs/qwen3-math

Hardware: 8 accelerators of 40 GB or more. Checked with: the deviceless compile of its
learner step and decode at these shapes (``tests/test_recipes.py``); not yet trained on
accelerators here.
"""

import dataclasses

from rlx.configs import _real as real, qwen25_math_grpo


def get_config():
  config = qwen25_math_grpo.get_config()
  return dataclasses.replace(
      config,
      name="qwen3_math",
      model=dataclasses.replace(config.model, path="models/Qwen3-1.7B", arch=real.QWEN3_17B),
      rollout=dataclasses.replace(config.rollout, max_new_tokens=4096, group_size=8),
      data=dataclasses.replace(config.data, prompts_per_step=32,
                               chat_template_kwargs='{"enable_thinking": true}'),
  )
