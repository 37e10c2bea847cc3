"""Rollout throughput: the engine with continuous batching, the same engine with static
batches, and naive generation that recomputes the whole sequence at every step.

    python benchmarks/rollout_throughput.py [--slots 8,32] [--requests 64] [--max-new 256]

Prints one JSON object. The model is the built-in tiny architecture with
near-uniform random weights; prompts are 16 tokens. Two workloads:

- ``fixed``: no stop tokens, every response is ``--max-new`` tokens;
- ``geometric``: four stop ids, so each step ends a response with probability
  about 4/V: lengths are geometric (mean ~V/4) and some reach the limit.

For each workload and slot count: decode tokens/s and completions/s of
(a) ``continuous``, (b) ``static`` and, on the fixed workload, (c) ``naive``;
and the ratios a/c (target >= 5 at 256 new tokens) and a/b on the geometric
workload (target >= 1.3). Each figure is the median of --repeats runs after a
warm-up run that compiles.
"""

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlx import rollout
from rlx.config import ArchConfig
from rlx.models import init_model
from rlx.rollout.engine import Engine


def naive_generate(model, prompts, max_new_tokens, seed=0):
  """Recomputes the full (padded) sequence at every step: no KV cache. Static batch."""
  batch, prompt_len = len(prompts), len(prompts[0])
  total = prompt_len + max_new_tokens
  tokens = jnp.zeros((batch, total), jnp.int32).at[:, :prompt_len].set(jnp.array(prompts))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(tokens, position, key):
    mask = jnp.arange(total)[None, :] < position
    logits, _ = model.transformer(model.params, tokens, mask)
    next_logits = jax.lax.dynamic_index_in_dim(logits, position - 1, axis=1, keepdims=False)
    drawn = jax.random.categorical(jax.random.fold_in(key, position), next_logits)
    return jax.lax.dynamic_update_index_in_dim(tokens, drawn, position, axis=1)

  key = jax.random.key(seed)
  for position in range(prompt_len, total):
    tokens = step(tokens, position, key)
  return np.asarray(tokens[:, prompt_len:])


def timed(fn, repeats):
  fn()  # compile and warm up
  times = []
  for _ in range(repeats):
    started = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - started)
  return statistics.median(times), out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--slots", default="8,32")
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--max-new", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  arch = ArchConfig()
  model = init_model(arch, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, arch.vocab_size, size=(args.requests, 16)).tolist()
  stops = {"fixed": [], "geometric": [1, 2, 3, 4]}
  report = {"device": jax.devices()[0].device_kind, "requests": args.requests,
            "max_new_tokens": args.max_new, "prompt_len": 16, "vocab": arch.vocab_size,
            "layers": arch.num_layers, "hidden": arch.hidden_size, "results": {}}
  for slots in map(int, args.slots.split(",")):
    engine = Engine(model.transformer, max_slots=slots, max_len=16 + args.max_new, max_prompt_len=16)
    for workload, stop in stops.items():
      entry = {}
      for batching in ("continuous", "static"):
        run = lambda: rollout.generate(engine, prompts, params=model.params, max_new_tokens=args.max_new,
                                       temperature=1.0, stop_token_ids=stop, batching=batching)
        seconds, completions = timed(run, args.repeats)
        lengths = [len(c.response_tokens) for c in completions]
        entry[batching] = {"seconds": round(seconds, 3),
                           "decode_tokens_per_s": round(sum(lengths) / seconds, 1),
                           "completions_per_s": round(len(completions) / seconds, 2),
                           "mean_length": round(float(np.mean(lengths)), 1),
                           "hit_limit": int(sum(n == args.max_new for n in lengths))}
      if workload == "fixed":
        # Naive recompute, static batches of `slots` prompts.
        def naive():
          return [naive_generate(model, prompts[i:i + slots], args.max_new)
                  for i in range(0, len(prompts), slots)]
        seconds, _ = timed(naive, args.repeats)
        tokens = len(prompts) * args.max_new
        entry["naive"] = {"seconds": round(seconds, 3),
                          "decode_tokens_per_s": round(tokens / seconds, 1),
                          "completions_per_s": round(len(prompts) / seconds, 2)}
        entry["continuous_vs_naive"] = round(
            entry["continuous"]["decode_tokens_per_s"] / entry["naive"]["decode_tokens_per_s"], 2)
      entry["continuous_vs_static"] = round(
          entry["continuous"]["decode_tokens_per_s"] / entry["static"]["decode_tokens_per_s"], 2)
      report["results"][f"slots{slots}_{workload}"] = entry
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
