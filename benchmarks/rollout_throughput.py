"""Rollout throughput: the engine with continuous batching, the same engine with static
batches, naive generation that recomputes the whole sequence at every step, and
Hugging Face ``generate`` on the same weights.

    python benchmarks/rollout_throughput.py [--slots 32,64] [--requests 64] [--max-new 128]
        [--decode-steps 1,4,16] [--compare-hf]

Prints one JSON object. The model is a Llama-style decoder with random weights: 4 layers,
hidden 256, 4 query / 2 KV heads, MLP 512, vocab 512; prompts are 16 tokens. Two workloads:

- ``fixed``: no stop tokens, every response is ``--max-new`` tokens;
- ``geometric``: four stop ids, so each step ends a response with probability
  about 4/V: lengths are geometric (mean ~V/4) and some reach the limit.

For each workload and slot count: decode tokens/s and completions/s of
(a) ``continuous``, (b) ``static`` and, on the fixed workload, (c) ``naive``;
and the ratios a/c (target >= 5 at 256 new tokens) and a/b on the geometric
workload (target >= 1.3). Each figure is the median of --repeats runs after a
warm-up run that compiles.

``--decode-steps`` sweeps the engine's tokens per dispatch on the fixed workload
(``decode_steps_sweep``). ``--compare-hf`` (needs the ``bench`` extra: torch and
transformers) saves the weights with ``rlx.models.save_pretrained``, loads them with
``transformers``, and times ``generate(do_sample=True)`` on the same prompts with the same
number of new tokens (no early stop, top-k and top-p off, one static batch of --requests),
next to rlx's continuous batching with as many slots (``vs_hf``: tokens/s and ratio).
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


BENCH_ARCH = ArchConfig(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                        intermediate_size=512, vocab_size=512)


def hf_generate(model, prompts, max_new_tokens, repeats, threads):
  """Median seconds of Hugging Face ``generate`` on the same weights (torch, CPU)."""
  import tempfile

  import torch
  import transformers

  from rlx.models import save_pretrained
  torch.set_num_threads(threads)
  with tempfile.TemporaryDirectory() as directory:
    save_pretrained(model, directory)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
  hf.eval()
  inputs = torch.tensor(prompts)
  settings = dict(do_sample=True, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                  top_k=0, top_p=1.0, temperature=1.0, attention_mask=torch.ones_like(inputs),
                  pad_token_id=0)

  def run():
    with torch.inference_mode():
      return hf.generate(inputs, **settings)

  seconds, out = timed(run, repeats)
  assert out.shape == (len(prompts), len(prompts[0]) + max_new_tokens), out.shape
  return seconds, {"torch": torch.__version__, "transformers": transformers.__version__,
                   "threads": threads}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--slots", default="32,64")
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--max-new", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--decode-steps", default="", help="comma-separated sweep, e.g. 1,4,8,16,32")
  parser.add_argument("--compare-hf", action="store_true")
  parser.add_argument("--hf-threads", type=int, default=2)
  parser.add_argument("--no-naive", action="store_true", help="skip the naive recompute baseline")
  args = parser.parse_args()

  arch = BENCH_ARCH
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
      if workload == "fixed" and not args.no_naive:
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
  fixed = lambda engine: lambda: rollout.generate(
      engine, prompts, params=model.params, max_new_tokens=args.max_new, temperature=1.0,
      stop_token_ids=[])
  if args.decode_steps:
    sweep = {}
    for steps in map(int, args.decode_steps.split(",")):
      engine = Engine(model.transformer, max_slots=args.requests, max_len=16 + args.max_new,
                      max_prompt_len=16, decode_steps=steps)
      seconds, _ = timed(fixed(engine), args.repeats)
      sweep[steps] = round(len(prompts) * args.max_new / seconds, 1)
    report["decode_steps_sweep"] = {"slots": args.requests, "decode_tokens_per_s": sweep}
  if args.compare_hf:
    engine = Engine(model.transformer, max_slots=args.requests, max_len=16 + args.max_new,
                    max_prompt_len=16)
    hf_seconds, versions = hf_generate(model, prompts, args.max_new, args.repeats, args.hf_threads)
    rlx_seconds, _ = timed(fixed(engine), args.repeats)
    tokens = len(prompts) * args.max_new
    report["vs_hf"] = {
        "requests": len(prompts), "new_tokens": args.max_new, **versions,
        "rlx_decode_steps": engine.decode_steps,
        "rlx_tokens_per_s": round(tokens / rlx_seconds, 1),
        "hf_tokens_per_s": round(tokens / hf_seconds, 1),
        "ratio": round(hf_seconds / rlx_seconds, 2)}
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
