"""Speed on a real model, SmolLM2-135M-Instruct, against Hugging Face transformers on the same
weights, one after the other in one process.

    python -m rlx.fetch --out models/SmolLM2-135M-Instruct     # once
    python benchmarks/real_model.py [--model models/SmolLM2-135M-Instruct] [--sequences 32,64]
        [--new-tokens 64] [--learner-batch 64] [--repeats 2] [--threads 2] [--skip-torch]
        [--parts decode,learner] [--dtype float32|bfloat16]

Prints one JSON object:

- ``decode``: for each number of sequences, rlx's engine (continuous batching, as many slots as
  sequences) and ``transformers`` ``generate`` on the same chat prompts (the built-in
  ``word_sums`` problems), both sampling at temperature 1 with top-k/top-p off and no early
  stop (every sequence decodes ``--new-tokens``): decode tokens/s and the ratio rlx / HF.
- ``learner``: the trainer's learner step (prepare + update: GRPO, one optimizer step, AdamW,
  float32, full remat as the recipe runs it; ``--remat full,none`` also without) on ``--learner-batch``
  sequences of ~100 tokens (the prompts above, responses of 32-64 tokens), against a plain
  torch step on the same model and batch (forward, masked mean log-prob loss, backward in
  micro-batches of ``--torch-micro`` sequences with the gradients accumulated, AdamW);
  tokens/s counts the sequences' own tokens, and the ratio rlx / torch.
- ``peak_rss_gib``: the process's peak resident memory when it ends (both frameworks).

``--dtype bfloat16`` decodes with both models' weights and compute in bfloat16 (rlx's
``model.dtype`` and ``param_dtype``, transformers' ``dtype``), with ``--parts decode``.

Each figure is the median of ``--repeats`` runs after one that compiles (or warms torch up).
torch runs with ``--threads`` threads (the CPU's cores); compare on a quiet machine: torch and
XLA suffer differently from other load.
"""

import argparse
import dataclasses
import json
import resource

import jax
import jax.numpy as jnp
import numpy as np

from rlx import rollout, update
from rlx.config import RunConfig
from rlx.data.tasks import task_rows
from rlx.models import from_pretrained, load_tokenizer
from rlx.rollout.engine import Engine
from rlx.trainer.draw import _bucket
from rlx.trainer.learn.experience import Sampled, make_prepare

import rollout_throughput  # the benchmark beside this one: its timer


def timed(fn, repeats):
  """Median seconds of ``fn`` over ``repeats`` runs after a warm-up run."""
  return rollout_throughput.timed(fn, repeats)[0]


def prompts_of(tokenizer, count):
  rows = task_rows("word_sums", count, seed=1)
  return [tokenizer.encode_prompt(row["prompt"]) for row in rows]


def rlx_decode(model, prompts, new_tokens, repeats):
  width = max(map(len, prompts))
  engine = Engine(model.transformer, max_slots=len(prompts), max_len=width + new_tokens,
                  max_prompt_len=_bucket(width))
  run = lambda: rollout.generate(engine, prompts, params=model.params,  # noqa: E731
                                 max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=[])
  return timed(run, repeats)


def hf_decode(hf, prompts, new_tokens, repeats, pad_id):
  import torch
  width = max(map(len, prompts))
  ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  settings = dict(do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  top_k=0, top_p=1.0, temperature=1.0, attention_mask=mask, pad_token_id=pad_id)

  def run():
    with torch.inference_mode():
      out = hf.generate(ids, **settings)
    assert out.shape == (len(prompts), width + new_tokens), out.shape

  return timed(run, repeats)


def learner_batch(prompts, count, seed=0):
  """``count`` sequences laid out as the trainer lays them out: each prompt left-padded, a
  response of 32-64 random tokens right-padded, rewards 0/1."""
  rng = np.random.default_rng(seed)
  prompts = [prompts[i % len(prompts)] for i in range(count)]
  responses = rng.integers(32, 65, count)
  P, R = _bucket(max(map(len, prompts))), _bucket(int(responses.max()))
  tokens = np.zeros((count, P + R), np.int32)
  attention = np.zeros((count, P + R), bool)
  response_mask = np.zeros((count, P + R), bool)
  for i, (prompt, length) in enumerate(zip(prompts, responses)):
    tokens[i, P - len(prompt):P] = prompt
    tokens[i, P:P + length] = rng.integers(17, 49152, length)
    attention[i, P - len(prompt):P + length] = True
    response_mask[i, P:P + length] = True
  logprobs = np.where(response_mask, -rng.exponential(size=tokens.shape), 0).astype(np.float32)
  return Sampled(tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attention),
                 response_mask=jnp.asarray(response_mask),
                 behaviour_logprobs=jnp.asarray(logprobs),
                 rewards=jnp.asarray(rng.integers(0, 2, count), jnp.float32),
                 policy_version=jnp.zeros((count,), jnp.int32))


def rlx_learner(directory, sampled, remat, repeats, dtype="float32"):
  """Median seconds of the learner step; ``dtype`` computes (the master weights are float32)."""
  config = RunConfig()
  config = dataclasses.replace(
      config, model=dataclasses.replace(config.model, path=str(directory), remat=remat,
                                        dtype=dtype, param_dtype="float32"),
      algorithm=dataclasses.replace(config.algorithm, name="grpo"))
  model = from_pretrained(directory, dtype=dtype, param_dtype="float32", remat=remat)
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=1000)
  holder = {"state": update.init_train_state(model.params, optimizer, jax.random.key(0))}
  prepare = make_prepare(config, model.transformer)
  step_fn = update.make_update_step(config, model.transformer, optimizer, schedule)

  def step():
    state = holder["state"]
    state, metrics = step_fn(state, prepare(state.params, None, None, sampled))
    jax.block_until_ready(metrics)
    holder["state"] = state

  return timed(step, repeats)


def torch_learner(hf, sampled, repeats, micro):
  """A plain torch step in micro-batches of ``micro`` sequences, gradients accumulated (the
  whole batch at once holds [64, 128, 49152] float32 logits several times: over 18 GB)."""
  import torch
  tokens = torch.tensor(np.asarray(sampled.tokens), dtype=torch.long)
  attention = torch.tensor(np.asarray(sampled.attention_mask), dtype=torch.long)
  mask = torch.tensor(np.asarray(sampled.response_mask)[:, 1:], dtype=torch.float32)
  optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-6)
  hf.train()

  def step():
    optimizer.zero_grad()
    for start in range(0, len(tokens), micro):
      part = slice(start, start + micro)
      logits = hf(tokens[part], attention_mask=attention[part]).logits[:, :-1]
      logprobs = torch.log_softmax(logits.float(), -1).gather(
          -1, tokens[part, 1:, None])[..., 0]
      loss = -(logprobs * mask[part]).sum() / mask.sum()
      loss.backward()
    optimizer.step()

  seconds = timed(step, repeats)
  hf.eval()
  return seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
  parser.add_argument("--sequences", default="32,64")
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--learner-batch", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--skip-torch", action="store_true")
  parser.add_argument("--parts", default="decode,learner")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                      help="the decode's weights and compute, both frameworks")
  parser.add_argument("--torch-micro", type=int, default=8,
                      help="sequences per torch forward/backward (gradients accumulated)")
  parser.add_argument("--remat", default="full",
                      help="the learner's remat settings to time, comma-separated (full,none: "
                           "none keeps every layer's activations, ~9.5 GB at 64 sequences)")
  args = parser.parse_args()
  parts = args.parts.split(",")
  if args.dtype != "float32" and "learner" in parts:
    parser.error("--dtype bfloat16 times the decode only: add --parts decode")

  tokenizer = load_tokenizer(args.model)
  model = from_pretrained(args.model, dtype=args.dtype, param_dtype=args.dtype)
  hf = None
  report = {"model": args.model, "device": jax.devices()[0].device_kind, "dtype": args.dtype,
            "new_tokens": args.new_tokens, "decode": {}, "learner": {}}
  if not args.skip_torch:
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype)).eval()
    report.update(torch=torch.__version__, transformers=transformers.__version__,
                  threads=args.threads)
  for count in map(int, args.sequences.split(",") if "decode" in parts else []):
    prompts = prompts_of(tokenizer, count)
    tokens = count * args.new_tokens
    entry = {"rlx_tokens_per_s": round(tokens / rlx_decode(model, prompts, args.new_tokens,
                                                           args.repeats), 1)}
    if hf is not None:
      entry["hf_tokens_per_s"] = round(tokens / hf_decode(hf, prompts, args.new_tokens,
                                                          args.repeats, tokenizer.pad_id), 1)
      entry["rlx_over_hf"] = round(entry["rlx_tokens_per_s"] / entry["hf_tokens_per_s"], 2)
    report["decode"][str(count)] = entry
    print(json.dumps({"decode": {count: entry}}), flush=True)
  if "learner" not in parts:
    report["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(json.dumps(report, indent=1))
    return
  sampled = learner_batch(prompts_of(tokenizer, args.learner_batch), args.learner_batch)
  real = int(np.asarray(sampled.attention_mask).sum())
  report["learner"]["batch"] = {"sequences": args.learner_batch,
                                "mean_tokens": round(real / args.learner_batch, 1),
                                "padded_shape": list(sampled.tokens.shape)}
  remats = args.remat.split(",")
  for remat in remats:
    seconds = rlx_learner(args.model, sampled, remat, args.repeats)
    report["learner"][f"rlx_remat_{remat}_tokens_per_s"] = round(real / seconds, 1)
    print(json.dumps({"learner": {remat: round(real / seconds, 1)}}), flush=True)
  if hf is not None:
    seconds = torch_learner(hf, sampled, args.repeats, args.torch_micro)
    report["learner"]["torch_micro_batch"] = args.torch_micro
    report["learner"]["torch_tokens_per_s"] = round(real / seconds, 1)
    for remat in remats:
      report["learner"][f"rlx_remat_{remat}_over_torch"] = round(
          report["learner"][f"rlx_remat_{remat}_tokens_per_s"]
          / report["learner"]["torch_tokens_per_s"], 2)
  report["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
