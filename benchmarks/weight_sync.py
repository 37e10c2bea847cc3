"""Weight sync learner -> generator: what one policy version costs, in wall time and in CPU
time, for each way a split run ships it, at a few model sizes.

    python benchmarks/weight_sync.py [--sizes builtin,medium,smollm2] [--versions 12]
        [--dtypes float32,bfloat16] [--arms reshard,orbax,delta] [--lr 1e-5] [--whole-every 10]

``reshard``: one process, the learner's device to the generator's (``mesh.weight_sync=
reshard``; ``publish`` then ``latest``). ``orbax``: two jobs sharing the workdir
(``mesh.weight_sync=orbax``): the learner's ``publish`` (asynchronous, as a learner job writes:
the seconds on its step's path), the write it leaves in the background, and the generator's
``latest`` (list the versions, restore the newest). Wall times are medians over
``--versions`` after two that warm up; CPU times are the process's (every thread) per
version, which is what the other job loses on a machine they share. ``delta``: two jobs
through rlx's own version files (``mesh.weight_sync=delta``, ``rlx.versions``): the learner's
publish, the write, the generator's read, and the bytes, for the whole versions and the deltas
apart, and ``delta_bytes_saved_frac``, the median delta's saving on the params' size. The
versions are successive Adam steps at ``--lr`` (the SmolLM2 recipe's) on float32 master
weights, published in each of ``--dtypes``. Prints JSON.
"""

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from rlx import sync  # noqa: E402
from rlx.versions import DeltaSync  # noqa: E402
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


def _versions(params, count: int, lr: float, snr: float = 0.1):
  """``count`` successive versions, each one Adam step (the recipe's: ``lr``, betas 0.9 and
  0.999) from the last, on float32 master weights, handed out in the params' dtype as a
  mixed-precision learner publishes them. The gradients are a fixed random direction plus
  noise ``1 / snr`` times larger, drawn afresh each step (a policy gradient is mostly noise):
  the first Adam step moves every element by ``lr``, later ones by a fraction of it."""
  master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  optimizer = optax.adam(lr)

  def keys(key):
    return jax.tree.unflatten(jax.tree.structure(master),
                              jax.random.split(key, len(jax.tree.leaves(master))))

  mean = jax.tree.map(lambda x, k: snr * jax.random.normal(k, x.shape), master,
                      keys(jax.random.key(7)))

  @jax.jit
  def step(master, state, key):
    grads = jax.tree.map(lambda m, k: m + jax.random.normal(k, m.shape), mean, keys(key))
    updates, state = optimizer.update(grads, state, master)
    master = optax.apply_updates(master, updates)
    return master, state, jax.tree.map(lambda m, x: m.astype(x.dtype), master, params)

  state, key = optimizer.init(master), jax.random.key(1)
  for _ in range(count):
    key, now = jax.random.split(key)
    master, state, version = jax.block_until_ready(step(master, state, now))
    yield version


def measure(arch: ArchConfig, versions: int, dtype: str, lr: float, whole_every: int,
            arms: set[str]) -> dict:
  learner, generator = jax.devices()[:2]
  params = jax.device_put(jax.tree.map(lambda x: x.astype(dtype),
                                       init_params(arch, jax.random.key(0))), learner)
  shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(generator), params)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  result = {"bytes": nbytes, "arrays": len(jax.tree.leaves(params))}

  if "reshard" in arms:
    _reshard(params, shardings, versions, lr, result)
  if "orbax" in arms:
    _orbax(params, shardings, versions, lr, result)
  if "delta" in arms:
    _delta(params, shardings, versions, lr, whole_every, nbytes, result)
  return result


def _reshard(params, shardings, versions, lr, result):
  reshard, rows = sync.ReshardSync(shardings), []
  for v, version in enumerate(_versions(params, versions + 2, lr)):
    rows.append(_timed(lambda: (reshard.publish(version, v),
                                jax.block_until_ready(reshard.latest(v - 1)[0]))))
  result["reshard"] = _median(rows[2:])
  reshard.release()


def _orbax(params, shardings, versions, lr, result):
  with tempfile.TemporaryDirectory() as directory:
    writer = sync.OrbaxSync(f"{directory}/versions", shardings, like=params, keep=4,
                            asynchronous=True)
    reader = sync.OrbaxSync(f"{directory}/versions", shardings, like=params, keep=4)
    publish, background, read = [], [], []
    for v, version in enumerate(_versions(params, versions + 2, lr)):
      publish.append(_timed(lambda: writer.publish(version, v)))
      background.append(_timed(writer.flush))
      read.append(_timed(lambda: jax.block_until_ready(reader.latest(v - 1)[0])))
    writer.close()
    reader.close()
  result["orbax_publish"] = _median(publish[2:])
  result["orbax_background_write"] = _median(background[2:])
  result["orbax_latest"] = _median(read[2:])
  result["orbax_cpu_s_per_version"] = round(sum(
      result[k]["cpu_s"] for k in ("orbax_publish", "orbax_background_write", "orbax_latest")), 5)


def _delta(params, shardings, versions, lr, whole_every, nbytes, result):
  with tempfile.TemporaryDirectory() as directory:
    writer = DeltaSync(f"{directory}/versions", shardings, like=params, keep=4,
                       whole_every=whole_every)
    reader = DeltaSync(f"{directory}/versions", shardings, like=params, keep=4)
    rows = {"whole": {"publish": [], "write": [], "read": [], "bytes": []},
            "delta": {"publish": [], "write": [], "read": [], "bytes": []}}
    for v, version in enumerate(_versions(params, versions + 2, lr)):
      publish = _timed(lambda: writer.publish(version, v))
      write = _timed(writer.flush)
      read = _timed(lambda: jax.block_until_ready(reader.latest(v - 1)[0]))
      index = (pathlib.Path(directory) / "versions" / str(v) / "index.json").read_text()
      kind = "whole" if json.loads(index)["base"] is None else "delta"
      if v >= 1:  # the first compiles and allocates
        for name, value in (("publish", publish), ("write", write), ("read", read)):
          rows[kind][name].append(value)
        rows[kind]["bytes"].append(writer.written_bytes)
    writer.close()
    reader.close()
  for kind, row in rows.items():
    if row["bytes"]:
      result[f"{kind}_versions"] = {
          "count": len(row["bytes"]), "bytes": int(statistics.median(row["bytes"])),
          **{f"{name}_{key}": value for name in ("publish", "write", "read")
             for key, value in _median(row[name]).items()}}
  if rows["delta"]["bytes"]:
    result["delta_bytes_saved_frac"] = round(
        1 - statistics.median(rows["delta"]["bytes"]) / nbytes, 4)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="builtin,medium,smollm2")
  parser.add_argument("--versions", type=int, default=12)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--lr", type=float, default=1e-5, help="the SmolLM2 recipe's")
  parser.add_argument("--whole-every", type=int, default=10)
  parser.add_argument("--arms", default="reshard,orbax,delta")
  args = parser.parse_args()
  results = {f"{name}/{dtype}": measure(SIZES[name], args.versions, dtype, args.lr,
                                        args.whole_every, set(args.arms.split(",")))
             for name in args.sizes.split(",") for dtype in args.dtypes.split(",")}
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  main()
