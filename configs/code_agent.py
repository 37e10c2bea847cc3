"""The code task as an agent: the model may run its program against the row's first two tests
(the ``run_tests`` tool, in the sandbox), read which fail, and try again within three turns;
its final program is scored on every test by the ``code`` reward, as in
``configs/code_grpo.py``, which it is compared with on the same budget.

The warm-up shows one pattern on the task's reference programs: run the program, read
"all passed", answer with it.

    python -m rlx.main --config configs/code_agent.py --workdir /tmp/rlx-code-agent
"""

import dataclasses

from configs import code_grpo


def get_config():
  config = code_grpo.get_config()
  return dataclasses.replace(
      config,
      name="code_agent",
      rollout=dataclasses.replace(config.rollout, max_new_tokens=160),
      env=dataclasses.replace(config.env, name="code", max_turns=3, max_tokens=160,
                              turn_max_new_tokens=64, tool_timeout_s=8.0),
  )
