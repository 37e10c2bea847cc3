"""The code task as an agent: the model may run its program against the row's first two tests
(the ``run_tests`` tool, in the sandbox), read which fail, and try again within three turns;
its final program is scored on every test by the ``code`` reward, as in
``configs/code_grpo.py``, which it is compared with on the same budget.

The warm-up shows one pattern on the task's reference programs: run the program, read
"all passed", answer with it.

Measured on a 2-core CPU against ``configs/code_grpo.py``, one run after the other, at the same
budget of 20 steps (``--config.trainer.steps=20 --config.trainer.eval_every=20
--config.trainer.eval_prompts=100``): held-out pass rate 4.0% -> 11.0% here, 5.0% -> 8.0%
single-turn. Episodes run the tests 0.88 times on average (an unreadable call is counted in
``agent/malformed_calls``: the model must escape newlines in it). The agent costs 2.5x the wall time
(1506 s against 613 s: a sandbox run per tool call, longer warm-up sequences), and on 100
problems the difference is within the noise: a longer comparison is still to be made.

    python -m rlx.main --config configs/code_agent.py --workdir /tmp/rlx-code-agent
"""

import dataclasses

from rlx.configs import code_grpo


def get_config():
  config = code_grpo.get_config()
  return dataclasses.replace(
      config,
      name="code_agent",
      rollout=dataclasses.replace(config.rollout, max_new_tokens=160),
      env=dataclasses.replace(config.env, name="code", max_turns=3, max_tokens=160,
                              turn_max_new_tokens=64, tool_timeout_s=8.0),
  )
