"""Weight sync learner -> generator: what one policy version costs, in wall time and in CPU
time, for each way a split run ships it, at a few model sizes.

    python benchmarks/weight_sync.py [--sizes builtin,medium,smollm2] [--versions 12]

``reshard``: one process, the learner's device to the generator's (``mesh.weight_sync=
reshard``; ``publish`` then ``latest``). ``orbax``: two jobs sharing the workdir
(``mesh.weight_sync=orbax``): the learner's ``publish`` (asynchronous, as a learner job writes:
the seconds on its step's path), the write it leaves in the background, and the generator's
``latest`` (list the versions, restore the newest). Wall times are medians over
``--versions`` after two that warm up; CPU times are the process's (every thread) per
version, which is what the other job loses on a machine they share. Prints JSON.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402

from rlx import sync  # noqa: E402
from rlx.config import ArchConfig  # noqa: E402
from rlx.models.transformer import init_params  # noqa: E402

SIZES = {
    "builtin": ArchConfig(),
    "medium": ArchConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8,
                         num_heads=8, num_kv_heads=4, head_dim=64),
    "smollm2": ArchConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64),
}


def _timed(fn) -> tuple[float, float]:
  wall, cpu = time.perf_counter(), time.process_time()
  fn()
  return time.perf_counter() - wall, time.process_time() - cpu


def _median(pairs: list[tuple[float, float]]) -> dict:
  return {"wall_s": round(statistics.median(p[0] for p in pairs), 5),
          "cpu_s": round(statistics.median(p[1] for p in pairs), 5)}


def measure(arch: ArchConfig, versions: int) -> dict:
  learner, generator = jax.devices()[:2]
  params = jax.device_put(init_params(arch, jax.random.key(0)), learner)
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(generator), params)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  bump = jax.jit(lambda p, v: jax.tree.map(lambda x: x + v, p))
  copies = [jax.block_until_ready(bump(params, float(v))) for v in range(2)]
  result = {"bytes": nbytes, "arrays": len(jax.tree.leaves(params))}

  reshard, rows = sync.ReshardSync(shardings), []
  for v in range(versions + 2):
    wall_cpu = _timed(lambda: (reshard.publish(copies[v % 2], v),
                               jax.block_until_ready(reshard.latest(v - 1)[0])))
    rows.append(wall_cpu)
  result["reshard"] = _median(rows[2:])
  reshard.release()

  with tempfile.TemporaryDirectory() as directory:
    writer = sync.OrbaxSync(f"{directory}/versions", shardings, like=params, keep=4,
                            asynchronous=True)
    reader = sync.OrbaxSync(f"{directory}/versions", shardings, like=params, keep=4)
    publish, background, read = [], [], []
    for v in range(versions + 2):
      publish.append(_timed(lambda: writer.publish(copies[v % 2], v)))
      background.append(_timed(writer.flush))
      read.append(_timed(lambda: jax.block_until_ready(reader.latest(v - 1)[0])))
    writer.close()
    reader.close()
  result["orbax_publish"] = _median(publish[2:])
  result["orbax_background_write"] = _median(background[2:])
  result["orbax_latest"] = _median(read[2:])
  result["orbax_cpu_s_per_version"] = round(sum(
      result[k]["cpu_s"] for k in ("orbax_publish", "orbax_background_write", "orbax_latest")), 5)
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="builtin,medium,smollm2")
  parser.add_argument("--versions", type=int, default=12)
  args = parser.parse_args()
  results = {name: measure(SIZES[name], args.versions) for name in args.sizes.split(",")}
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  main()
