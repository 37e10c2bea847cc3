"""The deployment advisor: measures a config's generation and learning on this machine with a
short probe, models every deployment from those measurements, and recommends one.

    python -m rlx.advise --config configs/dapo_split.py [--devices N] [--steps 3]
        [--out advise.json] [--config.a.b=value ...]

**Probe** (minutes at most). For colocated on all N devices, and for split at a few device
splits g (generation) + N - g (learning), it builds the run exactly as ``rlx.main`` would
(same model, engine, learner, weight sync; the built-in task's warm-up once, shared by all
of them), compiles, then times ``--steps`` rollout batches and updates:

- alone, one after the other: generation seconds per batch G, learning seconds per batch L
  (the update and the publish of the new weights), the sync seconds S;
- for split, also at the same time (a generator thread and a learner thread, as the split
  loop runs them): Gc and Lc, which include whatever the two sides take from each other
  (on a CPU they share the host's cores; on accelerators they barely interact).

**Model**, per batch of B samples:

- colocated: step = G + L (both phases on every device, in turn); lag 0;
- split, k = 0: step = G + L on the split's own devices (the sides take turns); lag 0;
- split, k >= 1: the sides overlap, each on its own batch. While both run, each is slowed by
  the factor measured at once (sg = Gc / G, sl = Lc / L); the faster side finishes its batch
  and waits (for the learner's next version, or for the next batch), and the slower one runs
  the rest alone at full speed: step = G sg + (L - G sg / sl) when generation finishes first,
  L sl + (G - L sl / sg) otherwise. The lag is k when learning is the slower side (the
  generator runs ahead to the bound) and about 1 when generation is (each batch is sampled
  while the learner trains the one before); a larger k only adds lag.

Splits not probed are interpolated (log-log in the device count) from those that were. The
advisor ranks deployments by predicted samples/s (ties go to less lag), prints the table,
the recommended overrides and the reasons, and writes the same as JSON.

**Episodes** (``env.name``): the probe also measures the share of an episode's life it holds
a decode slot (``agent/in_slot_frac``); for a split with k >= 1 the advisor adds continuous
admission and the ``mesh.groups_in_flight`` that keeps the slots decoding (``groups_needed``:
by Little's law), with the k whose k + 1 batches the gate admits hold them (up to --max-k).

**Memory** (``--target h100 v5e ...``): each probed deployment's learner step and decode chunk
are compiled for the target by its real compiler, without the device (``rlx.aot``), and the
per-device peak is reported; the recommendation is the fastest deployment that fits (90% of
the device's memory).

    JAX_PLATFORMS=cpu python -m rlx.advise --config configs/dapo_split.py --devices 8 --target h100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

from rlx import cli
from rlx.advise.model import Prediction, Probe, predict, reasons, stream_advice
from rlx.config import ConfigError, RunConfig, check


# --- the probe -----------------------------------------------------------------------------------


def _quiet(message: str) -> None:
  pass


def _median_seconds(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    started = time.perf_counter()
    fn()
    times.append(time.perf_counter() - started)
  return statistics.median(times)


def probe(config: RunConfig, name: str, workdir: pathlib.Path, steps: int,
          say=print) -> Probe:
  """Builds the run ``config`` describes and times its generation and learning."""
  from rlx.trainer.produce.collect import collect
  from rlx.trainer.setup.run import prepare
  from rlx.trainer.learn.learner import Learner

  run = prepare(config, workdir, _quiet)
  try:
    learner = Learner.for_run(run, _quiet)
    learner.publish()
    seeds = iter(range(10**6))
    params = [run.sync.latest()]
    draws = []

    def sample():  # as the generator does: the newest published params, then a batch
      params[0] = run.sync.latest() or params[0]
      return collect(run, lambda: params[0], seed=next(seeds))

    def generate():
      draws.append(sample())

    batches = iter(())

    def learn():  # over the batches drawn here, in turn: their shapes compile once each
      nonlocal batches
      draw = next(batches, None)
      if draw is None:
        batches = iter(list(draws))
        draw = next(batches)
      learner.learn(draw)
      learner.publish()

    say(f"rlx: advise: {name}: compiling")
    generate()  # compiles
    generate_s = _median_seconds(generate, steps)
    for _ in draws:  # compiles each batch's length bucket
      learn()
    learn_s = _median_seconds(learn, steps)
    sync_s = _median_seconds(learner.publish, steps)
    drawn = list(draws)

    tokens = statistics.mean(sum(len(c.response_tokens) for c in d.completions) for d in drawn)
    shares = [d.counts["agent/in_slot_frac"] for d in drawn if "agent/in_slot_frac" in d.counts]
    result = Probe(name, len(run.meshes.generation.devices.flat),
                   len(run.meshes.learning.devices.flat), generate_s, learn_s, sync_s,
                   tokens_per_batch=tokens,
                   in_slot_frac=statistics.median(shares) if shares else None)
    if config.mesh.mode == "split":
      result.generate_concurrent_s, result.learn_concurrent_s = _concurrent(
          sample, learn, max(generate_s, learn_s) * (steps + 1))  # beside it: not its batches
    say(f"rlx: advise: {name}: generate {result.generate_s:.2f}s, learn {result.learn_s:.2f}s"
        + (f"; at once: generate {result.generate_concurrent_s:.2f}s, learn "
           f"{result.learn_concurrent_s:.2f}s" if result.generate_concurrent_s else "")
        + " per batch")
    return result
  finally:
    run.close()


def _concurrent(generate, learn, seconds: float) -> tuple[float, float]:
  """Seconds per call of each of ``generate`` and ``learn`` while both run at once, each in its
  own thread, for about ``seconds``: the median of the calls that finished while the other
  side was still working."""
  deadline = time.perf_counter() + seconds
  done = {}

  def loop(name, fn):
    times = []
    while True:
      started = time.perf_counter()
      fn()
      finished = time.perf_counter()
      times.append(finished - started)
      if finished > deadline and len(times) >= 2:
        break
    done[name] = times

  threads = [threading.Thread(target=loop, args=("generate", generate)),
             threading.Thread(target=loop, args=("learn", learn))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  # the last call of the side that finished first ran partly alone: leave out each side's last
  return (statistics.median(done["generate"][:-1] or done["generate"]),
          statistics.median(done["learn"][:-1] or done["learn"]))


def splits_to_probe(devices: int) -> list[int]:
  """A few generation-device counts: half, and a quarter and three quarters when distinct."""
  candidates = {devices // 2, devices // 4, devices - devices // 4}
  return sorted(g for g in candidates if 0 < g < devices)


# --- the command -------------------------------------------------------------------------------


def _table(predictions: list[Prediction], top: int, targets: list[str]) -> str:
  header = (f"{'deployment':<28} {'samples/s':>9} {'step s':>7} {'lag':>5} "
            f"{'gen busy':>8} {'learn busy':>10}  {'basis':<12}"
            + "".join(f" {t + ' GiB/dev':>13}" for t in targets))

  def memory(p: Prediction, target: str) -> str:
    m = p.memory.get(target)
    if m is None:
      return f" {'-':>13}"
    if m["status"] != "ok":
      return f" {'fails':>13}"
    return f" {m['peak_gib']:>9.2f}{'' if m['fits'] else ' !':<4}"

  rows = [f"{p.label:<28} {p.samples_per_s:>9.2f} {p.step_s:>7.2f} {p.policy_lag:>5.1f} "
          f"{p.generation_busy_frac:>8.0%} {p.learning_busy_frac:>10.0%}  {p.basis:<12}"
          + "".join(memory(p, t) for t in targets)
          for p in predictions[:top]]
  return "\n".join([header, *rows])


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m rlx.advise",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True, help="a config file, e.g. configs/dapo_split.py")
  parser.add_argument("--devices", type=int, default=None,
                      help="devices to plan for (default: all this machine has; on CPU, "
                           "config.mesh.cpu_devices)")
  parser.add_argument("--steps", type=int, default=3, help="batches timed per measurement")
  parser.add_argument("--max-k", type=int, default=2, help="largest staleness bound to model")
  parser.add_argument("--out", default="advise.json", help="where the JSON goes")
  parser.add_argument("--workdir", default=None, help="probe runs' directory (default: temporary)")
  parser.add_argument("--target", nargs="+", default=[], choices=["h100", "a100", "v5e", "v6e"],
                      help="also compile each deployment for these accelerators (without them) "
                           "and report per-device memory; needs the target's plugin (the "
                           "aot-cuda / aot-tpu extras) and JAX_PLATFORMS=cpu on a CPU machine")
  args, overrides = parser.parse_known_args(argv)
  unknown = [a for a in overrides if not a.startswith("--config.")]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides look like "
                 "--config.a.b=value)")
  try:
    config = check(cli.apply_overrides(cli.load_config_file(args.config), overrides))
    devices = args.devices or config.mesh.cpu_devices
    if devices < 2:
      raise ConfigError("--devices must be >= 2: a split needs a device for each side")
    config = cli.apply_overrides(config, [
        f"--config.mesh.cpu_devices={devices}", "--config.mesh.role=both",
        "--config.mesh.weight_sync=reshard", "--config.logging.progress_bar=false",
        "--config.logging.tensorboard=false", "--config.checkpoint.every_steps=0",
        "--config.mesh.lag_threshold=None", "--config.data.max_age_s=None",
        "--config.algorithm.max_is_clip_frac=None"])
  except ConfigError as error:
    print(f"rlx: advise: {error}", file=sys.stderr)
    return 2
  from rlx.main import start_jax

  if args.target:
    from rlx import aot

    aot.environment()
  jax = start_jax(config)
  if args.devices is None and jax.default_backend() != "cpu":
    devices = jax.device_count()  # mesh.cpu_devices counts fake CPU devices only
  for target in args.target:  # a missing compiler is reported before minutes of probing
    try:
      aot.devices(target, 1)
    except aot.TargetUnavailable as error:
      print(f"rlx: advise: {error}", file=sys.stderr)
      return 2
  if jax.device_count() != devices:
    print(f"rlx: advise: --devices {devices} but this process has {jax.device_count()} "
          f"{jax.default_backend()} devices; plan for all of them, or hide some "
          "(CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS)", file=sys.stderr)
    return 2
  from rlx.trainer.setup.warmup import warms_up

  root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="rlx-advise-"))
  started = time.perf_counter()
  print(f"rlx: advise: probing {config.name} on {devices} {jax.default_backend()} devices "
        f"({args.steps} batches of {config.samples_per_step} samples per measurement)")
  probes, warm = [], []
  plans = [("colocated", ["--config.mesh.mode=colocated"])] + [
      (f"split {g}+{devices - g}", ["--config.mesh.mode=split",
                                    f"--config.mesh.generation_devices={g}",
                                    f"--config.mesh.max_staleness={max(args.max_k, 1)}"])
      for g in splits_to_probe(devices)]
  for i, (name, extra) in enumerate(plans):
    workdir = root / name.replace(" ", "_").replace("+", "_")
    variant = cli.apply_overrides(config, [*extra, *warm])
    if i == 0 and warms_up(variant):
      print(f"rlx: advise: the built-in warm-up first ({config.trainer.warmup_sft_steps} "
            "steps), so that response lengths are a trained model's")
    probes.append(probe(variant, name, workdir, args.steps))
    if not warm and (workdir / "warmup").is_dir():
      warm = [f"--config.model.path={workdir / 'warmup'}"]
  predictions = predict(probes, devices, config.samples_per_step, args.max_k)
  for target in args.target:
    print(f"rlx: advise: compiling each deployment for {target}")
    memory = aot.deployment_memory(config, target, devices, splits_to_probe(devices))
    for p in predictions:
      if p.name in memory:
        p.memory[target] = memory[p.name]
  best = next((p for p in predictions if p.fits), predictions[0])
  why = reasons(best, predictions, probes)
  print(f"\nrlx: advise: predicted, best first (batch of {config.samples_per_step} samples):")
  print(_table(predictions, top=12, targets=args.target))
  if not best.fits:
    print("rlx: advise: no deployment fits the target's memory (! marks those that do not); "
          "use more devices, a smaller batch or bf16 params")
  stream = stream_advice(config, best, probes, args.max_k)
  overrides = best.overrides()
  if stream:  # its k replaces the batch model's
    overrides = [o for o in overrides if "max_staleness" not in o] + stream["overrides"]
    why.append(stream["reason"])
  print(f"\nrecommended: {best.label}\n  " + " ".join(overrides))
  for line in why:
    print(f"  - {line}")
  result = {"config": args.config, "devices": devices, "backend": jax.default_backend(),
            "batch_samples": config.samples_per_step,
            "probe_seconds": time.perf_counter() - started,
            "probes": [dataclasses.asdict(p) for p in probes],
            "predictions": [dict(dataclasses.asdict(p), label=p.label, overrides=p.overrides())
                            for p in predictions],
            "recommended": dict(dataclasses.asdict(best), label=best.label,
                                overrides=overrides, stream=stream),
            "reasons": why}
  out = pathlib.Path(args.out)
  out.write_text(json.dumps(result, indent=1))
  print(f"rlx: advise: written to {out} ({result['probe_seconds']:.0f}s of probing)")
  return 0
