"""Time of one ``Engine.generate`` step (every slot decodes one token) by slots and cache length.

    python benchmarks/decode_step.py [--grid 8x272,32x272,32x1040] [--repeats 30]

Prints JSON: median milliseconds per decode step for each ``slots x max_len``, on
the built-in architecture. The cost should grow with the cache only through
attention, not through copying the cache.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from rlx.config import ArchConfig
from rlx.models import init_model
from rlx.rollout.engine import Engine


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--grid", default="8x272,32x272,32x1040")
  parser.add_argument("--repeats", type=int, default=30)
  args = parser.parse_args()
  model = init_model(ArchConfig(), jax.random.key(0))
  results = {}
  for cell in args.grid.split(","):
    slots, max_len = map(int, cell.split("x"))
    engine = Engine(model.transformer, max_slots=slots, max_len=max_len, max_prompt_len=16)
    state = engine.init_decode_state()
    state = state.replace(active=jnp.ones((slots,), bool), sampling=state.sampling.replace(
        temperature=jnp.ones((slots,)), max_new_tokens=jnp.full((slots,), 10**6, jnp.int32)))
    state, step = engine.generate(model.params, state)  # compile
    jax.block_until_ready(step.tokens)
    times = []
    for _ in range(args.repeats):
      started = time.perf_counter()
      state, step = engine.generate(model.params, state)
      jax.block_until_ready(step.tokens)
      times.append(time.perf_counter() - started)
    results[cell] = round(1000 * statistics.median(times), 2)
  print(json.dumps({"device": jax.devices()[0].device_kind, "ms_per_decode_step": results}, indent=2))


if __name__ == "__main__":
  main()
