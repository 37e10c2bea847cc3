"""Model speed on this machine: compile time against depth, and forward / forward+backward tokens/s.

    python benchmarks/model_forward.py [--batch 8] [--seq 256] [--repeats 5]

Prints one JSON object:
  compile_s: {layers: seconds} to compile forward+backward of the built-in
      architecture at 2, 8 and 32 layers (layers are scanned, so this should
      stay nearly flat), and compile_ratio_32_vs_2;
  forward_tokens_per_s / train_tokens_per_s: median over repeats at the
      default depth, with remat 'none' and 'full'.
"""

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp

from rlx.config import ArchConfig
from rlx.models.transformer import Transformer, init_params


def _loss(params, tokens, model):
  hidden, _ = model.hidden_states(params, tokens)
  return jnp.mean(model.logits(params, hidden) ** 2)


def compile_seconds(arch: ArchConfig, tokens) -> float:
  model = Transformer(arch, remat="full")
  params = jax.eval_shape(lambda: init_params(arch, jax.random.key(0)))
  started = time.perf_counter()
  jax.jit(jax.grad(_loss), static_argnums=2).lower(params, tokens, model).compile()
  return time.perf_counter() - started


def median_seconds(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    started = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - started)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  arch = ArchConfig()
  tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq), 0, arch.vocab_size)
  compile_s = {n: compile_seconds(dataclasses.replace(arch, num_layers=n), tokens) for n in (2, 8, 32)}
  params = init_params(arch, jax.random.key(0))
  ntokens = args.batch * args.seq
  result = {
      "device": jax.devices()[0].device_kind, "layers": arch.num_layers, "hidden": arch.hidden_size,
      "batch": args.batch, "seq": args.seq,
      "compile_s": {str(n): round(s, 3) for n, s in compile_s.items()},
      "compile_ratio_32_vs_2": round(compile_s[32] / compile_s[2], 2),
  }
  forward = jax.jit(lambda p, t: Transformer(arch)(p, t)[0])
  result["forward_tokens_per_s"] = round(ntokens / median_seconds(forward, params, tokens,
                                                                  repeats=args.repeats))
  for remat in ("none", "full"):
    step = jax.jit(jax.grad(_loss), static_argnums=2)
    seconds = median_seconds(step, params, tokens, Transformer(arch, remat=remat), repeats=args.repeats)
    result[f"train_tokens_per_s_remat_{remat}"] = round(ntokens / seconds)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
