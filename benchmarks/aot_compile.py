"""Compiles rlx's accelerator programs for a GPU or TPU that is not there (the real XLA:TPU +
Mosaic, or XLA:GPU + Triton compilers, run on this machine), at the shapes of real models.

    python benchmarks/aot_compile.py --target v5e|v6e|h100|a100 [--tokens 4096,16384]

Needs the target's jaxlib plugin at the same version as jax (``pip install -e ".[aot-tpu]"``
or ``".[aot-cuda]"``, in a venv of its own) and JAX_PLATFORMS=cpu. It proves that a program
lowers and fits (shared memory, VMEM, device memory); it says nothing about speed.

Prints JSON: one entry per program (fused log-prob forward, and value_and_grad, for each
implementation, at each model width and token count): "ok" with the per-device argument,
output and temp memory in MiB, or "failed" with the first line of the compiler's error.
"""

import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_WORKER_ID", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from rlx.kernels.fused_logprobs import reference_logprobs, xla_logprobs  # noqa: E402
from rlx.kernels.pallas_logprobs import pallas_logprobs  # noqa: E402

TARGETS = pathlib.Path(__file__).parent / "targets"
# (name, model width D, vocabulary V) of real models
MODELS = [("qwen2.5-0.5b", 896, 151936), ("qwen2.5-1.5b", 1536, 151936),
          ("qwen2.5-7b", 3584, 152064), ("llama-3-8b", 4096, 128256)]
PLATFORM = {"v5e": "tpu", "v6e": "tpu", "h100": "cuda", "a100": "cuda"}


def devices(target: str, count: int = 1):
  """Compile-only devices of ``target``."""
  if PLATFORM[target] == "tpu":
    shape = {1: "1x1", 8: "2x4"}[count]
    return topologies.get_topology_desc(
        platform="tpu", topology_name=f"{target}:{shape}", chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1) if count == 1 else (2, 2, 1), num_slices=1,
        wrap=(False, False, False)).devices
  config = (TARGETS / f"{target}.txtpb").read_text()
  return topologies.get_topology_desc(platform="cuda", target_config=config,
                                      topology=f"1x1x{count}").devices


def _mib(value) -> float:
  return round(value / 2**20, 1)


def compile_one(fn, args, device) -> dict:
  sharding = jax.sharding.SingleDeviceSharding(device)
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  try:
    compiled = jax.jit(fn).trace(*specs).lower().compile()
  except Exception as error:  # noqa: BLE001 - the compiler's verdict is the result
    first = next((line for line in str(error).splitlines() if line.strip()), repr(error))
    return {"status": "failed", "error": first[:300]}
  memory = compiled.memory_analysis()
  return {"status": "ok", "argument_mib": _mib(memory.argument_size_in_bytes),
          "output_mib": _mib(memory.output_size_in_bytes),
          "temp_mib": _mib(memory.temp_size_in_bytes)}


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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", required=True, choices=sorted(PLATFORM))
  parser.add_argument("--tokens", default="4096,16384")
  parser.add_argument("--only", default="", help="run the programs whose name contains this")
  args = parser.parse_args()
  if PLATFORM[args.target] == "cuda":
    jax.config.update("jax_pallas_use_mosaic_gpu", False)  # the kernels are written for Triton
  device = devices(args.target)[0]
  results = {}
  for name, fn, program_args in logprob_programs(args.target, [int(t) for t in args.tokens.split(",")]):
    if args.only and args.only not in name:
      continue
    results[name] = compile_one(fn, program_args, device)
    print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
  failed = sum(r["status"] != "ok" for r in results.values())
  print(json.dumps({"target": args.target, "device": str(device.device_kind), "failed": failed,
                    "programs": results}, indent=2))


if __name__ == "__main__":
  main()
