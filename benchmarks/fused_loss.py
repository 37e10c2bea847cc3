"""Memory and time of the fused log-prob/entropy implementations, forward and forward+backward.

    python benchmarks/fused_loss.py [--repeats 3] [--impls reference,xla,pallas] [--time-large]

Prints one JSON object with, per shape and implementation:
  temp_mib_fwd / temp_mib_fwd_bwd: compiled peak temporary memory (XLA
      memory_analysis), measured for every shape without running it;
  seconds_fwd / seconds_fwd_bwd: median wall time over --repeats runs.
On CPU: T=4096, D=512, V=32768 fp32 (timed), and T=8192, D=896, V=151936 bf16
(Qwen2.5-0.5B-shaped; timed only with --time-large, since the reference needs
tens of GiB there); 'pallas' is skipped (it runs on GPU and TPU only). On GPU
and TPU: T=8192, D=896, V=151936 and T=16384, D=1536, V=151936, both bf16 and
timed, with pallas. Also the time ratios against the reference, and the
targets: on CPU, xla forward+backward temp <= 96 MiB at the first shape and
time <= 1.1x the reference; on GPU, pallas faster than the reference and at
least 2x less memory than xla.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from rlx.kernels import fused_logprobs

CPU_SHAPES = [
    {"name": "T4096_D512_V32768_fp32", "T": 4096, "D": 512, "V": 32768, "dtype": "float32", "timed": True},
    {"name": "T8192_D896_V151936_bf16", "T": 8192, "D": 896, "V": 151936, "dtype": "bfloat16", "timed": False},
]
ACCELERATOR_SHAPES = [
    {"name": "T8192_D896_V151936_bf16", "T": 8192, "D": 896, "V": 151936, "dtype": "bfloat16", "timed": True},
    {"name": "T16384_D1536_V151936_bf16", "T": 16384, "D": 1536, "V": 151936, "dtype": "bfloat16", "timed": True},
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
  parser.add_argument("--impls", default="reference,xla,pallas")
  parser.add_argument("--time-large", action="store_true", help="also time the large shape")
  args = parser.parse_args()
  backend = jax.default_backend()
  on_cpu = backend == "cpu"
  impls = [i for i in args.impls.split(",") if not (on_cpu and i == "pallas")]
  report = {"backend": backend, "device": jax.devices()[0].device_kind, "shapes": {}}
  if on_cpu and "pallas" in args.impls:
    report["pallas"] = "skipped: the Pallas kernels run on GPU and TPU (CPU tests use interpret mode)"
  shapes = CPU_SHAPES if on_cpu else ACCELERATOR_SHAPES
  for shape in shapes:
    timed = shape["timed"] or args.time_large
    entry = {}
    for impl in impls:
      try:
        entry[impl] = measure(shape, impl, args.repeats, timed)
      except Exception as error:  # e.g. out of memory for the reference at the largest shape
        entry[impl] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    for impl in ("xla", "pallas"):
      for label in ("fwd", "fwd_bwd"):
        key = f"seconds_{label}"
        if key in entry.get(impl, {}) and key in entry.get("reference", {}):
          entry[f"{impl}_vs_reference_time_{label}"] = round(
              entry[impl][key] / entry["reference"][key], 3)
    report["shapes"][shape["name"]] = entry
  first = report["shapes"][shapes[0]["name"]]
  if on_cpu and "temp_mib_fwd_bwd" in first.get("xla", {}):
    report["target_fwd_bwd_temp_le_96mib"] = first["xla"]["temp_mib_fwd_bwd"] <= 96
    if "xla_vs_reference_time_fwd_bwd" in first:
      report["target_time_le_1.1x_reference"] = first["xla_vs_reference_time_fwd_bwd"] <= 1.1
  if not on_cpu:
    for name, entry in report["shapes"].items():
      pallas, xla = entry.get("pallas", {}), entry.get("xla", {})
      if "temp_mib_fwd_bwd" in pallas and "temp_mib_fwd_bwd" in xla:
        entry["target_pallas_2x_less_memory_than_xla"] = (
            2 * pallas["temp_mib_fwd_bwd"] <= xla["temp_mib_fwd_bwd"])
      if "pallas_vs_reference_time_fwd_bwd" in entry:
        entry["target_pallas_faster_than_reference"] = entry["pallas_vs_reference_time_fwd_bwd"] < 1
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
