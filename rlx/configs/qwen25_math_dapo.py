"""DAPO on grade-school math, split: Qwen2.5-1.5B-Instruct on a GSM8K-format JSONL, 4
accelerators generating while 4 learn.

Data and model as in ``qwen25_math_grpo.py`` (download both first). DAPO's pieces as its
paper sets them (its preset): clip-higher (0.2 / 0.28), token-level loss, dynamic sampling,
and the soft overlong punishment over the last 512 tokens of a 2048 budget; 16 samples per
prompt. Split with staleness at most one version, corrected by truncated importance
sampling.

    python -m rlx.main --config configs/qwen25_math_dapo.py --workdir runs/qwen25-dapo

Hardware: 8 accelerators of 40 GB or more (4 generate, 4 learn with FSDP). Checked with: the
deviceless compile of its learner step and decode at these shapes
(``tests/test_recipes.py``); not yet trained on accelerators here.
"""

import dataclasses

from rlx.configs import _real as real, qwen25_math_grpo


def get_config():
  config = qwen25_math_grpo.get_config()
  return dataclasses.replace(
      config,
      name="qwen25_math_dapo",
      model=dataclasses.replace(config.model, path="models/Qwen2.5-1.5B-Instruct",
                                arch=real.QWEN25_15B),
      rollout=dataclasses.replace(config.rollout, max_new_tokens=2048, group_size=16),
      algorithm=dataclasses.replace(config.algorithm, name="dapo", overlong_buffer=512,
                                    off_policy="tis"),
      mesh=dataclasses.replace(config.mesh, mode="split", generation_devices=4,
                               max_staleness=1),
      data=dataclasses.replace(config.data, prompts_per_step=32),
  )
