"""Compiles rlx's accelerator programs for a GPU or TPU that is not there (the real XLA:TPU +
Mosaic, or XLA:GPU + Triton compilers, run on this machine), at the shapes of real models.

    python benchmarks/aot_compile.py --target v5e|v6e|h100|a100 [--tokens 4096,16384]

Needs the target's jaxlib plugin at the same version as jax (``pip install -e ".[aot-tpu]"``
or ``".[aot-cuda]"``, in a venv of its own) and JAX_PLATFORMS=cpu. It proves that a program
lowers and fits (shared memory, VMEM, device memory); it says nothing about speed.

Prints JSON: one entry per program: the fused log-prob forward and value_and_grad for each
implementation at each model width and token count; the learner's whole update step (GRPO,
bf16 activations, fp32 params, the Pallas loss, full remat) for a Qwen2.5-0.5B-shaped model
on 1 device and FSDP over 8; the engine's decode step on 1 device. Each is "ok" with the
per-device argument, output and temp memory in MiB, or "failed" with the first line of the
compiler's error.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_WORKER_ID", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import numpy as np  # noqa: E402

from rlx.aot import (PLATFORM, compile_one, devices, learner_program,  # noqa: E402
                     placed as _placed)
from rlx.config import (AlgorithmConfig, ArchConfig, DataConfig, ModelConfig,  # noqa: E402
                        OptimizerConfig, RolloutConfig, RunConfig, TrainerConfig)
from rlx.kernels.fused_logprobs import reference_logprobs, xla_logprobs  # noqa: E402
from rlx.kernels.pallas_logprobs import pallas_logprobs  # noqa: E402
from rlx.mesh import MESH_AXES  # noqa: E402
from rlx.models import Transformer  # noqa: E402
from rlx.rollout.engine import Engine, _generate_chunk, _generate_one  # noqa: E402

# (name, model width D, vocabulary V) of real models
MODELS = [("qwen2.5-0.5b", 896, 151936), ("qwen2.5-1.5b", 1536, 151936),
          ("qwen2.5-7b", 3584, 152064), ("llama-3-8b", 4096, 128256)]
QWEN_05B = ArchConfig(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True,
                      rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=32768)


def logprob_programs(target: str, tokens: list[int]):
  """(name, fn, args) of the fused log-prob forward and value_and_grad, per implementation."""
  variant = "tpu" if PLATFORM[target] == "tpu" else "gpu"
  impls = {
      "pallas": lambda h, u, t, m: pallas_logprobs(h, u, t, m, variant=variant),
      "xla": lambda h, u, t, m: tuple(jnp.where(m, x, 0.0) for x in xla_logprobs(h, u, t)),
      "reference": lambda h, u, t, m: tuple(jnp.where(m, x, 0.0)
                                            for x in reference_logprobs(h, u, t)),
  }
  for model, width, vocab in MODELS:
    for count in tokens:
      args = (jax.ShapeDtypeStruct((count, width), jnp.bfloat16),
              jax.ShapeDtypeStruct((width, vocab), jnp.bfloat16),
              jax.ShapeDtypeStruct((count,), jnp.int32), jax.ShapeDtypeStruct((count,), bool))
      for impl, fn in impls.items():
        def loss(h, u, t, m, fn=fn):
          logprob, entropy = fn(h, u, t, m)
          return jnp.sum(logprob) + 0.01 * jnp.sum(entropy)

        yield f"{model}/T={count}/{impl}/forward", fn, args
        yield f"{model}/T={count}/{impl}/value_and_grad", jax.value_and_grad(loss, (0, 1)), args


def learner_step(target: str, count: int, tokens_per_row: int = 1024, rows: int = 16):
  """The learner's update step for a Qwen2.5-0.5B-shaped model, FSDP over ``count`` devices:
  (jitted step, abstract args), as ``rlx.aot.learner_program`` builds it for a run."""
  mesh = jax.sharding.Mesh(np.array(devices(target, count)).reshape(1, count, 1), MESH_AXES)
  group = 8
  config = RunConfig(model=ModelConfig(arch=QWEN_05B, dtype="bfloat16", remat="full"),
                     rollout=RolloutConfig(max_prompt_len=tokens_per_row // 2,
                                           max_new_tokens=tokens_per_row // 2, group_size=group),
                     data=DataConfig(prompts_per_step=rows // group),
                     algorithm=AlgorithmConfig(name="grpo"),
                     optimizer=OptimizerConfig(learning_rate=1e-6),
                     trainer=TrainerConfig(mini_batches=2))
  return learner_program(config, mesh)


def decode_step(target: str, slots: int = 64, max_len: int = 2048, steps: int = 1):
  """The engine's decode (every slot ``steps`` tokens, attending to the whole cache) for a
  Qwen2.5-0.5B-shaped model on one device: (jitted step, abstract args)."""
  device = devices(target)[0]
  transformer = Transformer(QWEN_05B, jnp.bfloat16, "fused", "none")
  engine = Engine(transformer, max_slots=slots, max_len=max_len, max_prompt_len=1024,
                  platform=PLATFORM[target])
  params = jax.eval_shape(lambda: transformer.init(jax.random.key(0), jnp.bfloat16))
  state = jax.eval_shape(engine.init_decode_state)
  placed = jax.sharding.SingleDeviceSharding(device)
  args = (transformer, _placed(params, placed), _placed(state, placed))
  if steps == 1:
    return _generate_one, args + (max_len, None)
  return _generate_chunk, args + (steps, max_len, None)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", required=True, choices=sorted(PLATFORM))
  parser.add_argument("--tokens", default="4096,16384")
  parser.add_argument("--only", default="", help="run the programs whose name contains this")
  args = parser.parse_args()
  if PLATFORM[args.target] == "cuda":
    jax.config.update("jax_pallas_use_mosaic_gpu", False)  # the kernels are written for Triton
  device, platform = devices(args.target)[0], PLATFORM[args.target]
  results = {}

  def record(name, fn, program_args, on_device):
    if args.only and args.only not in name:
      return
    results[name] = compile_one(fn, program_args, device if on_device else None, platform)
    print(f"{name}: {results[name]}", file=sys.stderr, flush=True)

  for name, fn, program_args in logprob_programs(args.target, [int(t) for t in args.tokens.split(",")]):
    record(name, fn, program_args, on_device=True)
  for count in (1, 8):
    name = f"qwen2.5-0.5b/learner_update_step/{count}_devices"
    if not args.only or args.only in name:
      record(name, *learner_step(args.target, count), on_device=False)
  for steps, name in ((1, "decode_step"), (16, "decode_chunk16")):
    record(f"qwen2.5-0.5b/{name}/1_device", *decode_step(args.target, steps=steps), on_device=False)
  failed = sum(r["status"] != "ok" for r in results.values())
  print(json.dumps({"target": args.target, "device": str(device.device_kind), "failed": failed,
                    "programs": results}, indent=2))


if __name__ == "__main__":
  main()
