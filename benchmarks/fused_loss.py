"""Memory and time of the fused log-prob/entropy implementations, forward and forward+backward.

    python benchmarks/fused_loss.py [--repeats 3] [--impls reference,xla] [--time-large]

Prints one JSON object with, per shape and implementation:
  temp_mib_fwd / temp_mib_fwd_bwd: compiled peak temporary memory (XLA
      memory_analysis), measured for every shape without running it;
  seconds_fwd / seconds_fwd_bwd: median wall time over --repeats runs.
Shapes: T=4096, D=512, V=32768 fp32 (timed), and T=8192, D=896, V=151936 bf16
(Qwen2.5-0.5B-shaped; timed only with --time-large, since the reference needs
tens of GiB there). Also xla_vs_reference time ratios and the memory target
of the first shape (forward+backward temp <= 96 MiB).
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from rlx.kernels import fused_logprobs

SHAPES = [
    {"name": "T4096_D512_V32768_fp32", "T": 4096, "D": 512, "V": 32768, "dtype": "float32", "timed": True},
    {"name": "T8192_D896_V151936_bf16", "T": 8192, "D": 896, "V": 151936, "dtype": "bfloat16", "timed": False},
]


def _functions(impl):
  def forward(hidden, unembed, targets):
    return fused_logprobs(hidden, unembed, targets, impl=impl)

  def loss(hidden, unembed, targets):
    logprobs, entropy = forward(hidden, unembed, targets)
    return jnp.sum(logprobs) + 0.01 * jnp.sum(entropy)

  return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1)))


def _median_seconds(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    started = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - started)
  return round(statistics.median(times), 4)


def measure(shape, impl, repeats, timed):
  dtype = jnp.dtype(shape["dtype"])
  specs = (jax.ShapeDtypeStruct((shape["T"], shape["D"]), dtype),
           jax.ShapeDtypeStruct((shape["D"], shape["V"]), dtype),
           jax.ShapeDtypeStruct((shape["T"],), jnp.int32))
  forward, backward = _functions(impl)
  result = {}
  for label, fn in (("fwd", forward), ("fwd_bwd", backward)):
    compiled = fn.lower(*specs).compile()
    result[f"temp_mib_{label}"] = round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)
  if timed:
    keys = jax.random.split(jax.random.key(0), 3)
    args = ((0.5 * jax.random.normal(keys[0], specs[0].shape)).astype(dtype),
            (jax.random.normal(keys[1], specs[1].shape) / shape["D"] ** 0.5).astype(dtype),
            jax.random.randint(keys[2], (shape["T"],), 0, shape["V"]))
    result["seconds_fwd"] = _median_seconds(forward, args, repeats)
    result["seconds_fwd_bwd"] = _median_seconds(backward, args, repeats)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--impls", default="reference,xla")
  parser.add_argument("--time-large", action="store_true", help="also time the large shape")
  args = parser.parse_args()
  report = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "shapes": {}}
  for shape in SHAPES:
    timed = shape["timed"] or args.time_large
    entry = {impl: measure(shape, impl, args.repeats, timed) for impl in args.impls.split(",")}
    if timed and "reference" in entry and "xla" in entry:
      for label in ("fwd", "fwd_bwd"):
        entry[f"xla_vs_reference_time_{label}"] = round(
            entry["xla"][f"seconds_{label}"] / entry["reference"][f"seconds_{label}"], 3)
    report["shapes"][shape["name"]] = entry
  first = report["shapes"][SHAPES[0]["name"]]
  if "xla" in first:
    report["target_fwd_bwd_temp_le_96mib"] = first["xla"]["temp_mib_fwd_bwd"] <= 96
    if "xla_vs_reference_time_fwd_bwd" in first:
      report["target_time_le_1.1x_reference"] = first["xla_vs_reference_time_fwd_bwd"] <= 1.1
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
