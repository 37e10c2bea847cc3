"""Learner step speed: tokens/s of the trainer's learner step (prepare + update) on one batch,
unpacked, with sequence packing and with shared prefixes.

    python benchmarks/learner_step.py [--batch 16] [--prompt 16] [--response 128]
        [--mix uniform|longtail|samples] [--samples WORKDIR/samples.jsonl]
        [--mini-batches 1] [--pack] [--groups 8 --share] [--model DIR]
        [--variants default,remat=none,logprob_chunk=64] [--profile DIR]

The SmolLM2 recipe's batches (4 prompts x 8 samples, ~50-token chat prompts, answers of at most
32 tokens), row per sample against shared prompts, at its model's size (remat full)::

    python benchmarks/learner_step.py --model models/SmolLM2-135M-Instruct --batch 32 \
        --groups 8 --prompt 50 --response 32 --mix longtail --share --variants remat=full

Prints JSON: for each variant (the default model config, or one field of
``config.model`` changed), the median seconds of the learner's step as the trainer runs
it: ``prepare`` (old log-probs when needed, advantages) then ``update_step`` (one optimizer
step per mini-batch, the state donated), the trained tokens/s (all slots of the rows computed
on, padding included) and the real tokens/s (the sequences' own tokens), median of --repeats
after a warm-up step that compiles. ``--pack`` also runs each variant with sequence packing
(``trainer.pack_sequences``), alternating with the unpacked step on the same batch, and
reports both layouts' padding fraction (``train/pad_frac``, ``train/packed_pad_frac``) and
the ratio of real tokens/s. ``--groups N`` gives each N consecutive rows one prompt (a GRPO
group's); ``--share`` then also runs the shared-prefix layout (``trainer.share_prefix``: each
group's prompt once per packed row) and reports its speed-up over the unpacked step.
``--model DIR`` takes the architecture of a Hugging Face model directory (random weights: the
speed is the architecture's), else the benchmark architecture of ``rollout_throughput.py``.

Length mixes: ``uniform`` responses of ``--response/2`` to ``--response`` tokens after a
``--prompt``-token prompt; ``longtail`` responses drawn from an exponential of mean
``--response/4`` (cut at ``--response``), as RL on reasoning tasks produces; ``samples`` the
prompt and response lengths of a run's ``samples.jsonl`` (the built-in tokenizer's token
counts), e.g. the headline command's.
``--profile DIR`` writes a ``jax.profiler`` trace of --repeats steps of the first variant.
Run it on two commits side by side to compare them.
"""

import argparse
import dataclasses
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlx import update
from rlx.config import RunConfig
from rlx.models import init_model
from rlx.trainer.draw import _bucket
from rlx.trainer.learn.experience import Sampled, make_prepare
from rlx.update import packing

from rollout_throughput import BENCH_ARCH


def _lengths(mix: str, batch: int, prompt: int, response: int, samples: str | None,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """(prompt lengths, response lengths) [batch] of the chosen mix."""
  if mix == "uniform":
    return np.full(batch, prompt), rng.integers(response // 2, response + 1, batch)
  if mix == "longtail":
    return (np.full(batch, prompt),
            np.clip(rng.exponential(response / 4, batch).astype(int) + 1, 1, response))
  if mix == "samples":
    from rlx.models.tokenizer import builtin_tokenizer
    tokenizer = builtin_tokenizer()
    rows = [json.loads(line) for line in open(samples)]
    picked = [rows[i] for i in rng.choice(len(rows), batch, replace=False)]
    return (np.array([len(tokenizer.encode_prompt(r["prompt"])) for r in picked]),
            np.array([r["response_tokens"] for r in picked]))
  raise ValueError(f"unknown --mix {mix!r}")


def _sampled(prompts: np.ndarray, responses: np.ndarray, vocab: int, seed: int = 0,
             groups: int = 1) -> Sampled:
  """Rows laid out as the trainer does: left-padded prompts, right-padded responses, each
  part bucketed to a power of two; each ``groups`` consecutive rows share one prompt."""
  rng = np.random.default_rng(seed)
  batch = len(prompts)
  prompts = np.repeat(prompts[::groups], groups)[:batch]
  P, R = _bucket(int(prompts.max())), _bucket(int(responses.max()))
  T = P + R
  tokens = rng.integers(0, vocab, (batch, T)).astype(np.int32)
  tokens[:, :P] = np.repeat(tokens[::groups, :P], groups, axis=0)[:batch]
  positions = np.arange(T)[None]
  attention = (positions >= (P - prompts)[:, None]) & (positions < (P + responses)[:, None])
  response_mask = (positions >= P) & attention
  logprobs = np.where(response_mask, -rng.exponential(size=(batch, T)), 0.0).astype(np.float32)
  return Sampled(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attention),
                 response_mask=jnp.asarray(response_mask), behaviour_logprobs=jnp.asarray(logprobs),
                 rewards=jnp.asarray(rng.integers(0, 2, batch), jnp.float32),
                 policy_version=jnp.zeros((batch,), jnp.int32))


def _config(variant: str, mini_batches: int, arch) -> RunConfig:
  config = RunConfig()
  model = dataclasses.replace(config.model, arch=arch)
  if variant != "default":
    name, value = variant.split("=")
    field = type(getattr(model, name))
    model = dataclasses.replace(model, **{name: field(value)})
  return dataclasses.replace(config, model=model,
                             algorithm=dataclasses.replace(config.algorithm, name="grpo"),
                             trainer=dataclasses.replace(config.trainer,
                                                         mini_batches=mini_batches))


def measure(variant: str, sampled: Sampled, repeats: int, mini_batches: int,
            layouts: list[str], arch, profile: str | None = None) -> dict:
  """Median seconds of the learner step in each of ``layouts`` ('unpacked', 'packed',
  'shared'), alternating on the same batch."""
  config = _config(variant, mini_batches, arch)
  m = config.model
  model = init_model(m.arch, jax.random.key(0), dtype=m.dtype, attention=m.attention, remat=m.remat)
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=1000)
  state = update.init_train_state(model.params, optimizer, jax.random.key(0))
  prepare = make_prepare(config, model.transformer)
  update_step = update.make_update_step(config, model.transformer, optimizer, schedule)
  lengths = np.asarray(sampled.attention_mask).sum(1)
  links = np.asarray(packing.shared_prefixes(sampled.tokens, sampled.attention_mask,
                                             sampled.response_mask))
  B, T = sampled.tokens.shape
  micro = config.optimizer.micro_batches
  slots = {layout: [] for layout in layouts}

  def step(state, layout):
    chunks = schedule_plan = None
    if layout != "unpacked":  # as the learner makes them: from the lengths and this step's order
      shared = links if layout == "shared" else None
      chunks = packing.chunk_plan(lengths, mini_batches * micro, T, links=shared)
      order = np.asarray(update.schedule_order(state, B, epochs=1, mini_batches=mini_batches))
      schedule_plan = packing.schedule_plan(lengths, order, micro, T, links=shared)
    slots[layout].append(B * T if schedule_plan is None else
                         schedule_plan.row.shape[0] * micro * schedule_plan.rows
                         * (schedule_plan.width or T))
    batch = prepare(state.params, None, None, sampled, packing=chunks)
    return update_step(state, batch, packing=schedule_plan)

  times = {layout: [] for layout in layouts}
  for layout in layouts:  # compile
    state, metrics = step(state, layout)
    jax.block_until_ready(metrics)
  if profile:
    jax.profiler.start_trace(profile)
  for _ in range(repeats):
    for layout in layouts:
      started = time.perf_counter()
      state, metrics = step(state, layout)
      jax.block_until_ready(metrics)
      times[layout].append(time.perf_counter() - started)
  if profile:
    jax.profiler.stop_trace()
  real = int(lengths.sum())
  result = {}
  for layout in layouts:
    seconds = statistics.median(times[layout])
    used = statistics.median(slots[layout])
    result[layout] = {
        "seconds": round(seconds, 4), "tokens_per_s": round(used / seconds, 1),
        "real_tokens_per_s": round(real / seconds, 1), "slots": int(used),
        "pad_frac": round(packing.pad_fraction(lengths, B * T), 4)}
  for layout in layouts[1:]:
    result[f"{layout}_over_unpacked"] = round(result["unpacked"]["seconds"]
                                              / result[layout]["seconds"], 3)
  result["loss_finite"] = bool(np.isfinite(float(metrics["loss"])))
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--response", type=int, default=128)
  parser.add_argument("--mix", default="uniform", choices=["uniform", "longtail", "samples"])
  parser.add_argument("--samples", default=None, help="a run's samples.jsonl (--mix samples)")
  parser.add_argument("--mini-batches", type=int, default=1)
  parser.add_argument("--pack", action="store_true")
  parser.add_argument("--groups", type=int, default=1, help="rows per prompt (a GRPO group)")
  parser.add_argument("--share", action="store_true", help="also the shared-prefix layout")
  parser.add_argument("--model", default=None, help="a Hugging Face model directory's arch")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--variants", default="default")
  parser.add_argument("--profile", default=None)
  args = parser.parse_args()
  if args.mix == "samples" and not args.samples:
    parser.error("--mix samples needs --samples WORKDIR/samples.jsonl")
  prompts, responses = _lengths(args.mix, args.batch, args.prompt, args.response, args.samples,
                                np.random.default_rng(0))
  arch = BENCH_ARCH
  if args.model:
    from rlx.models import hf
    arch = hf.arch_from_hf(json.loads((pathlib.Path(args.model) / "config.json").read_text()))
  sampled = _sampled(prompts, responses, arch.vocab_size, groups=args.groups)
  layouts = ["unpacked"] + ["packed"] * args.pack + ["shared"] * args.share
  results = {}
  for i, variant in enumerate(args.variants.split(",")):
    results[variant] = measure(variant, sampled, args.repeats, args.mini_batches, layouts, arch,
                               args.profile if i == 0 else None)
  print(json.dumps({"device": jax.devices()[0].device_kind, "batch": args.batch, "mix": args.mix,
                    "tokens_per_row": int(sampled.tokens.shape[1]),
                    "mean_real_tokens": float(np.asarray(sampled.attention_mask).sum(1).mean()),
                    "groups": args.groups, "arch": args.model or "benchmark",
                    "mini_batches": args.mini_batches, "results": results}, indent=2))


if __name__ == "__main__":
  main()
