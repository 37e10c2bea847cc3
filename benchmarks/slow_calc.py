"""The ``calc`` environment with a calculator that takes 0-2 s per call (uniformly random), as a
slow tool (a web search, a test runner) would: for measuring how decode slots keep busy while
episodes wait for their tools.

    python -m rlx.main --config configs/agent_calc.py --workdir /tmp/rlx-slow \\
        --config.env.name=benchmarks/slow_calc.py:make_env
"""

import random
import time

from rlx.envs.builtin import TaskEnv
from rlx.envs.builtin import calculator as exact


def calculator(expression: str) -> str:
  """Evaluates an arithmetic expression exactly.

  Args:
    expression: integers, + - * / and parentheses, e.g. "123*4567".
  """
  time.sleep(random.uniform(0.0, 2.0))
  return exact(expression)


def make_env(row: dict) -> TaskEnv:
  return TaskEnv(row, (calculator,))
