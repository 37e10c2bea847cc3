"""The ``calc`` agent as a black-box program (``examples/calc_agent.py``) that reaches the
policy only through an ``openai.AsyncOpenAI`` client: the run serves the policy on an
OpenAI-compatible endpoint while it generates, records every request's ids and log-probs, and
trains on the merged trajectories. Everything else is ``configs/agent_calc.py``'s, so that the
two can be compared. Needs ``pip install -e '.[serve]'``.

    python -m rlx.main --config configs/agent_calc_openai.py --workdir /tmp/rlx-calc-openai

Measured on 2 CPU cores from the warm-up of an ``agent_calc`` run: held-out accuracy 0.0% ->
79.0% in 100 steps (the built-in environment: 0.0% -> 79.0%), RL loop 12.1 minutes.
"""

import dataclasses
import pathlib

from rlx.configs import agent_calc

AGENT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "calc_agent.py"  # the checkout's


def get_config():
  config = agent_calc.get_config()
  return dataclasses.replace(
      config, name="agent_calc_openai",
      env=dataclasses.replace(config.env, name="", agent=f"{AGENT}:run", agent_timeout_s=120.0))
