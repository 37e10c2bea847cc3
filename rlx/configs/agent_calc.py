"""An agent with a tool: DAPO on a split mesh, multi-turn episodes on the ``calc`` task.

The built-in model is asked for products of two 3-digit numbers, which it cannot compute
in its head. It may call ``calculator("347*582")``; the result comes back as the environment's
turn and the model writes the answer. The warm-up shows the tool on 30% of the rows and a
direct (memorised, hence wrong on new problems) answer on the rest; RL has to learn that
calling the tool pays, and to copy its result exactly.

    python -m rlx.main --config configs/agent_calc.py --workdir /tmp/rlx-calc
    python -m rlx.main --config configs/agent_calc.py --workdir /tmp/rlx-calc-colocated \\
        --config.mesh.mode=colocated
"""

import dataclasses

from rlx.configs import dapo_split


def get_config():
  config = dapo_split.get_config()
  return dataclasses.replace(
      config,
      name="agent_calc",
      data=dataclasses.replace(config.data, source="calc"),
      rollout=dataclasses.replace(config.rollout, max_prompt_len=32, max_new_tokens=64),
      env=dataclasses.replace(config.env, name="calc", max_turns=3, max_tokens=64,
                              turn_max_new_tokens=32, tool_timeout_s=5.0),
      # a longer warm-up than the single-turn tasks': copying 3-digit operands into the call and
      # the 6-digit result into the answer takes the tiny model ~300 steps of tool examples,
      # and only 30% of the rows show the tool
      # every one of the 900 steps (the tool's rows are a minority a stop at a share would
      # not wait for); no entropy bonus: the run measured in docs/agents.md had none
      trainer=dataclasses.replace(config.trainer, steps=100, eval_every=50, eval_prompts=200,
                                  warmup_sft_steps=900, warmup_sft_until=0.0),
      algorithm=dataclasses.replace(config.algorithm, entropy_target=None),
  )
