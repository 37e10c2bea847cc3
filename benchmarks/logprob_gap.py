"""The sampler-vs-learner gap at lag 0: how far the learner's log-probs of the tokens the
generator sampled are from the generator's own, by batch shape and dtype.

    python benchmarks/logprob_gap.py [--model models/SmolLM2-135M-Instruct] [--prompts 4]
        [--group 8] [--new-tokens 32] [--dtypes float32,bfloat16] [--micro 1,2,4]

The SmolLM2 recipe's batches (``configs/smollm2_math.py``): ``--prompts`` ``word_sums``
problems x ``--group`` samples at temperature 0.7, decoded by rlx's engine with the weights the
learner then holds (lag 0). The learner's log-probs of those tokens come from its own forward
path (``rlx.update.policy_logprobs`` over micro-batches, as ``prepare`` and the update compute
them), for each micro-batch count and row layout: ``unpacked`` (a row per sample),
``packed`` (samples packed into rows) and ``shared`` (a group's samples behind one copy of
their prompt, the recipe's default). For each: max, p99 and mean of |learner - behaviour| over
the sampled tokens; the share of tokens whose ratio exp(learner - behaviour) is off 1 by more
than 1 % and 10 %; and the largest difference from the same dtype's micro-batch-1 unpacked
log-probs (``vs_reference``: 0 where the learner's log-prob of a token does not depend on where
its sequence sits in a batch); ``rows``: the rows the batch took (``packed`` takes as many as
``unpacked`` where no two samples fit in one row). Prints JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from rlx import rollout, update  # noqa: E402
from rlx.configs import smollm2_math  # noqa: E402
from rlx.data.tasks import task_rows  # noqa: E402
from rlx.models import from_pretrained, load_tokenizer  # noqa: E402
from rlx.trainer.draw import _bucket  # noqa: E402
from rlx.trainer.learn.experience import _by_micro_batch  # noqa: E402
from rlx.update import packing as packing_lib  # noqa: E402


def sampled_rows(completions, temperature: float):
  """Left-padded prompts, right-padded responses (each part bucketed), behaviour log-probs at
  each sampled token's position, as the trainer lays a batch out."""
  P = _bucket(max(len(c.prompt_tokens) for c in completions))
  R = _bucket(max(len(c.response_tokens) for c in completions))
  B, T = len(completions), P + R
  tokens = np.zeros((B, T), np.int32)
  attention = np.zeros((B, T), bool)
  response = np.zeros((B, T), bool)
  behaviour = np.zeros((B, T), np.float32)
  for b, c in enumerate(completions):
    p, r = len(c.prompt_tokens), len(c.response_tokens)
    tokens[b, P - p:P], tokens[b, P:P + r] = c.prompt_tokens, c.response_tokens
    attention[b, P - p:P + r] = True
    response[b, P:P + r] = True
    behaviour[b, P:P + r] = c.logprobs
  return (jnp.asarray(tokens), jnp.asarray(attention), jnp.asarray(response),
          jnp.full((B,), temperature, jnp.float32)), behaviour, response


def learner_logprobs(config, model, inputs, micro: int, layout: str) -> tuple[np.ndarray, int]:
  """The learner's log-probs, and how many rows the batch took in this layout."""
  tokens, attention, response, temperature = inputs
  plan = None
  if layout != "unpacked":
    lengths = np.asarray(attention).sum(1)
    links = (np.asarray(packing_lib.shared_prefixes(tokens, attention, response))
             if layout == "shared" else None)
    plan = packing_lib.chunk_plan(lengths, micro, tokens.shape[1], links=links)
  fn = functools.partial(update.policy_logprobs, config, model.transformer, model.params)
  run = jax.jit(lambda *xs, packing=None: _by_micro_batch(fn, micro, *xs, packing=packing))
  rows = tokens.shape[0] if plan is None else micro * plan.rows
  return np.asarray(run(*inputs, packing=plan)), rows


def gap(learner: np.ndarray, behaviour: np.ndarray, mask: np.ndarray,
        reference: np.ndarray) -> dict:
  diff = np.abs(learner - behaviour)[mask]
  ratio_off = np.abs(np.exp(learner - behaviour) - 1)[mask]
  return {"max": float(diff.max()), "p99": float(np.quantile(diff, 0.99)),
          "mean": float(diff.mean()), "ratio_off_1pct": float((ratio_off > 0.01).mean()),
          "ratio_off_10pct": float((ratio_off > 0.10).mean()),
          "vs_reference": float(np.abs(learner - reference)[mask].max())}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
  parser.add_argument("--prompts", type=int, default=4)
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--micro", default="1,2,4")
  parser.add_argument("--layouts", default="unpacked,packed,shared")
  args = parser.parse_args()
  recipe = smollm2_math.get_config()
  tokenizer = load_tokenizer(args.model)
  prompts = [tokenizer.encode_prompt(r["prompt"])
             for r in task_rows("word_sums", args.prompts, seed=3)]
  results = {"model": args.model, "tokens_per_batch": None, "by_dtype": {}}
  for dtype in args.dtypes.split(","):
    model = from_pretrained(args.model, dtype=dtype, remat=recipe.model.remat)
    config = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, dtype=dtype))
    completions = rollout.generate(model, prompts, n=args.group, max_new_tokens=args.new_tokens,
                                   temperature=args.temperature, seed=0)
    inputs, behaviour, mask = sampled_rows(completions, args.temperature)
    results["tokens_per_batch"] = int(mask.sum())
    reference, _ = learner_logprobs(config, model, inputs, 1, "unpacked")
    rows = {}
    for layout in args.layouts.split(","):
      for micro in map(int, args.micro.split(",")):
        learner, used = learner_logprobs(config, model, inputs, micro, layout)
        rows[f"{layout}/micro{micro}"] = dict(gap(learner, behaviour, mask, reference),
                                              rows=used)
        print(json.dumps({dtype: {f"{layout}/micro{micro}": rows[f"{layout}/micro{micro}"]}}),
              flush=True)
    results["by_dtype"][dtype] = rows
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
