"""GRPO (with DAPO's dynamic sampling and clip-higher) on the built-in code task: write a
one-line Python function from its description; each sampled program runs against the
row's assert tests in the code sandbox (``rlx.rewards.sandbox``) and scores the fraction
it passes.

The built-in model learns the ```python fence and the function's shape in the supervised
warm-up (on the task's reference programs: about 20% of held-out problems pass after it).
On a 2-core CPU, RL has not yet been seen to raise that within 100 steps: the model gets
the operator right and the constant, which it must copy from the prompt, mostly wrong.

    python -m rlx.main --config configs/code_grpo.py --workdir /tmp/rlx-code
"""

import dataclasses

from configs import base


def get_config():
  config = base.get_config()
  return dataclasses.replace(
      config,
      name="code_grpo",
      rollout=dataclasses.replace(config.rollout, max_prompt_len=80, max_new_tokens=48),
      # most groups score alike (the program is right or wrong the same way 8 times): dynamic
      # sampling keeps the groups that teach something, clip-higher lets rare good tokens grow
      algorithm=dataclasses.replace(config.algorithm, name="grpo", loss_agg="token-mean",
                                    dynamic_sampling=True, dynamic_sampling_max_draws=32,
                                    clip_eps_high=0.28),
      data=dataclasses.replace(config.data, source="code"),
      reward=dataclasses.replace(config.reward, name="code", code_scoring="fraction",
                                 code_timeout_s=3.0, timeout_s=5.0),
      # the model must learn to read the description and copy its constant into the program:
      # a longer warm-up than the sort task's
      trainer=dataclasses.replace(config.trainer, steps=300, eval_every=50, eval_prompts=100,
                                  mini_batches=2, warmup_sft_steps=300),
  )
