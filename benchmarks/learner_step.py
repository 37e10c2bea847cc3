"""Learner step speed: tokens/s of the trainer's GRPO learner step (prepare + update) on one batch.

    python benchmarks/learner_step.py [--batch 16] [--prompt 16] [--response 128]
        [--variants default,remat=none,logprob_chunk=64] [--profile DIR]

Prints JSON: for each variant (the default model config, or one field of
``config.model`` changed), the median seconds of the learner's step as the trainer runs
it: ``prepare`` (old log-probs when needed, advantages) then ``update_step`` (one optimizer
step on the whole batch, the state donated), and the trained tokens/s (batch x (prompt +
response) / seconds), median of --repeats after a warm-up step that compiles. The model is the benchmark architecture of ``rollout_throughput.py``.
``--profile DIR`` writes a ``jax.profiler`` trace of --repeats steps of the first variant.
Run it on two commits side by side to compare them.
"""

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlx import update
from rlx.config import RunConfig
from rlx.models import init_model
from rlx.trainer.experience import Sampled, make_prepare

from rollout_throughput import BENCH_ARCH


def _sampled(batch: int, prompt: int, response: int, seed: int = 0) -> Sampled:
  rng = np.random.default_rng(seed)
  T = prompt + response
  tokens = rng.integers(0, BENCH_ARCH.vocab_size, (batch, T)).astype(np.int32)
  lengths = rng.integers(response // 2, response + 1, batch)
  positions = np.arange(T)[None]
  attention = positions < (prompt + lengths)[:, None]
  response_mask = (positions >= prompt) & attention
  logprobs = np.where(response_mask, -rng.exponential(size=(batch, T)), 0.0).astype(np.float32)
  return Sampled(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attention),
                 response_mask=jnp.asarray(response_mask), behaviour_logprobs=jnp.asarray(logprobs),
                 rewards=jnp.asarray(rng.integers(0, 2, batch), jnp.float32),
                 policy_version=jnp.zeros((batch,), jnp.int32))


def _config(variant: str) -> RunConfig:
  config = RunConfig()
  model = dataclasses.replace(config.model, arch=BENCH_ARCH)
  if variant != "default":
    name, value = variant.split("=")
    field = type(getattr(model, name))
    model = dataclasses.replace(model, **{name: field(value)})
  return dataclasses.replace(config, model=model,
                             algorithm=dataclasses.replace(config.algorithm, name="grpo"))


def measure(variant: str, sampled: Sampled, repeats: int, profile: str | None = None) -> dict:
  config = _config(variant)
  m = config.model
  model = init_model(m.arch, jax.random.key(0), dtype=m.dtype, attention=m.attention, remat=m.remat)
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=1000)
  state = update.init_train_state(model.params, optimizer, jax.random.key(0))
  prepare = make_prepare(config, model.transformer)
  update_step = update.make_update_step(config, model.transformer, optimizer, schedule)

  def step(state):
    return update_step(state, prepare(state.params, None, None, sampled))

  state, metrics = step(state)  # compile
  jax.block_until_ready(metrics)
  times = []
  if profile:
    jax.profiler.start_trace(profile)
  for _ in range(repeats):
    started = time.perf_counter()
    state, metrics = step(state)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - started)
  if profile:
    jax.profiler.stop_trace()
  seconds = statistics.median(times)
  tokens = sampled.tokens.size
  return {"seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
          "loss_finite": bool(np.isfinite(float(metrics["loss"])))}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--response", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--variants", default="default")
  parser.add_argument("--profile", default=None)
  args = parser.parse_args()
  sampled = _sampled(args.batch, args.prompt, args.response)
  results = {}
  for i, variant in enumerate(args.variants.split(",")):
    results[variant] = measure(variant, sampled, args.repeats, args.profile if i == 0 else None)
  print(json.dumps({"device": jax.devices()[0].device_kind, "batch": args.batch,
                    "tokens_per_sequence": args.prompt + args.response, "results": results},
                   indent=2))


if __name__ == "__main__":
  main()
