"""Saves small checkpoints asynchronously in a loop until killed, printing each step it starts:
what tests/test_checkpoint.py kills at random moments.

    python tests/save_loop.py DIR [MAX_STEPS]
"""

import sys

import jax
import jax.numpy as jnp

from rlx import update
from rlx.checkpoint import Checkpointer
from rlx.config import CheckpointConfig, RunConfig


def state(seed: int):
  # random, so that the files do not compress away: a checkpoint takes about 800 KB
  params = {"w": jax.random.normal(jax.random.key(seed), (256, 256)), "b": jnp.arange(256.0) + seed}
  optimizer, _ = update.make_optimizer(RunConfig().optimizer, total_steps=10)
  return update.init_train_state(params, optimizer, jax.random.key(seed)).replace(
      step=jnp.asarray(seed, jnp.int32))


def main(directory: str, max_steps: int = 1_000_000) -> None:
  checkpointer = Checkpointer(directory, CheckpointConfig(max_to_keep=2, async_save=True))
  start = (checkpointer.latest_step() or 0) + 1
  for step in range(start, start + max_steps):
    checkpointer.save(step, state(step), data_state={"step": step}, meta={"step": step})
    print(f"started {step}", flush=True)
  checkpointer.close()


if __name__ == "__main__":
  main(sys.argv[1], *map(int, sys.argv[2:]))
