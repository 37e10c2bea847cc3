"""Milliseconds per decode step (every slot one token) by slots, cache length and filled length.

    python benchmarks/decode_step.py [--grid 32x144,32x1040] [--filled 128] [--repeats 20]
    python benchmarks/decode_step.py --lora-rank 16   # LoRA: merged vs unmerged generation

Prints JSON. For each ``slots x max_len`` on the benchmark architecture of
``rollout_throughput.py``, with every slot holding ``--filled`` tokens:

- ``single_step_whole_cache``: one dispatch per token, attending to the whole cache
  (the engine before chunking and attention buckets);
- ``single_step``: one dispatch per token, attending to the filled part (bucketed);
- ``chunk``: ``decode_steps`` tokens per dispatch (the engine's default), per token.

The cost should follow the filled length, not the cache length, and no step should copy
the cache.

With ``--lora-rank R`` (adapters on every projection), also per token in chunks:
``chunk_lora_unmerged`` (the engine running base + adapters, the low-rank path in every
projection) against ``chunk_lora_merged`` (the adapters folded into the weights once per
version, what rlx's generator does), and ``merge_ms``, what that fold costs per version.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import dataclasses
import functools

from rlx.config import LoraConfig
from rlx.models import init_model, lora
from rlx.rollout.engine import Engine

from rollout_throughput import BENCH_ARCH


def per_token_ms(engine, params, filled, attend_len, repeats):
  slots = engine.max_slots
  state = engine.init_decode_state()
  valid = jnp.broadcast_to(jnp.arange(engine.max_len) < filled, (slots, engine.max_len))
  state = state.replace(
      cache=dict(state.cache, index=jnp.full((slots,), filled, jnp.int32), valid=valid),
      active=jnp.ones((slots,), bool),
      sampling=state.sampling.replace(temperature=jnp.ones((slots,)),
                                      max_new_tokens=jnp.full((slots,), 10**6, jnp.int32)))
  fresh = lambda: jax.tree.map(jnp.copy, state)  # every field is donated to each step
  s, out = engine.generate(params, fresh(), attend_len)  # compile
  jax.block_until_ready(out.tokens)
  times = []
  for _ in range(repeats):
    s = fresh()
    jax.block_until_ready(s)
    started = time.perf_counter()
    s, out = engine.generate(params, s, attend_len)
    jax.block_until_ready(out.tokens)
    times.append((time.perf_counter() - started) / engine.decode_steps)
  return round(1000 * statistics.median(times), 3)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--grid", default="32x144,32x1040")
  parser.add_argument("--filled", type=int, default=100)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--lora-rank", type=int, default=0,
                      help="also time LoRA generation, merged against unmerged, at this rank")
  args = parser.parse_args()
  model = init_model(BENCH_ARCH, jax.random.key(0))
  results = {}
  for cell in args.grid.split(","):
    slots, max_len = map(int, cell.split("x"))
    single = Engine(model.transformer, max_slots=slots, max_len=max_len, max_prompt_len=16,
                    decode_steps=1)
    chunked = Engine(model.transformer, max_slots=slots, max_len=max_len, max_prompt_len=16)
    results[cell] = {
        "single_step_whole_cache": per_token_ms(single, model.params, args.filled, None, args.repeats),
        "single_step": per_token_ms(single, model.params, args.filled,
                                    single.attend_bucket(args.filled), args.repeats),
        "chunk": per_token_ms(chunked, model.params, args.filled,
                              chunked.attend_bucket(args.filled), args.repeats),
        "decode_steps": chunked.decode_steps}
    if args.lora_rank:
      results[cell].update(lora_arms(model, slots, max_len, args))
  print(json.dumps({"device": jax.devices()[0].device_kind, "filled": args.filled,
                    "ms_per_decode_step": results}, indent=2))


def lora_arms(model, slots, max_len, args) -> dict:
  """Per-token decode time with the adapters unmerged and merged, and the merge's time."""
  config = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
  adapters = lora.init_adapters(model.arch, config, jax.random.key(1))
  adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # B != 0: a trained adapter's cost
  adapted = dataclasses.replace(model.transformer, lora_scale=config.scale)
  unmerged = Engine(adapted, max_slots=slots, max_len=max_len, max_prompt_len=16)
  merged = Engine(model.transformer, max_slots=slots, max_len=max_len, max_prompt_len=16)
  merge = jax.jit(functools.partial(lora.merge, scale=config.scale))
  jax.block_until_ready(merge(model.params, adapters))
  times = []
  for _ in range(args.repeats):
    started = time.perf_counter()
    merged_params = jax.block_until_ready(merge(model.params, adapters))
    times.append(time.perf_counter() - started)
  attend = merged.attend_bucket(args.filled)
  return {"chunk_lora_unmerged": per_token_ms(unmerged, lora.combine(model.params, adapters),
                                              args.filled, attend, args.repeats),
          "chunk_lora_merged": per_token_ms(merged, merged_params, args.filled, attend,
                                            args.repeats),
          "merge_ms": round(1000 * statistics.median(times), 3), "lora_rank": args.lora_rank}


if __name__ == "__main__":
  main()
