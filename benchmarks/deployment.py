"""Colocated vs split deployment on the same work: samples/s, policy lag, busy fractions, sync
time and the reward reached, as JSON.

Both runs start from the same warmed-up model (the warm-up runs once, in the
first run's workdir, and the second loads it with ``--config.model.path``), use
the same algorithm (DAPO with truncated importance sampling), the same data, seed
and number of steps, and run as separate ``python -m rlx.main`` processes, one
after the other, on the same devices (fake CPU devices on a CPU machine).

    python benchmarks/deployment.py --steps 150 --cpu-devices 2

Busy fractions: split reports each sub-mesh's share of the loop's wall time spent
working; colocated reports the share of wall time each phase holds the (shared)
devices, so there the two add up to at most 1.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(mode: str, workdir: pathlib.Path, args, extra: list[str]) -> dict:
  command = [sys.executable, "-m", "rlx.main", "--config", "configs/dapo_split.py",
             "--workdir", str(workdir), f"--config.mesh.mode={mode}",
             f"--config.mesh.cpu_devices={args.cpu_devices}", f"--config.trainer.steps={args.steps}",
             f"--config.mesh.max_staleness={args.max_staleness}",
             "--config.trainer.eval_every=0", "--config.logging.progress_bar=false",
             "--config.logging.tensorboard=false", "--config.checkpoint.every_steps=0", *extra]
  started = time.perf_counter()
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - started
  if result.returncode:
    raise SystemExit(f"{mode} run failed:\n{result.stderr[-4000:]}")
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steady = rows[args.skip:]  # the first steps compile
  step_s = [r["time/step_s"] for r in steady]
  samples = sum(r["throughput/samples_per_s"] * r["time/step_s"] for r in steady)
  tail = rows[-args.tail:]
  report = {
      "steps": len(rows), "process_wall_s": round(wall, 1),
      "samples_per_s": round(samples / sum(step_s), 2),
      "step_s_median": round(statistics.median(step_s), 4),
      "policy_lag_mean": round(statistics.mean(r["rollout/policy_lag_mean"] for r in steady), 3),
      "policy_lag_max": max(r["rollout/policy_lag_max"] for r in rows),
      "sync_s_median": round(statistics.median(r["time/sync_s"] for r in steady), 5),
      "final_reward_mean": round(statistics.mean(r["reward/mean"] for r in tail), 4),
      "final_train_accuracy": round(statistics.mean(r["reward/accuracy"] for r in tail), 4),
  }
  if mode == "split":
    report["generation_busy_frac"] = round(rows[-1]["time/generation_busy_frac"], 3)
    report["learning_busy_frac"] = round(rows[-1]["time/learning_busy_frac"], 3)
    report["dropped_batches"] = rows[-1]["rollout/dropped_batches"]
  else:
    total = sum(step_s)
    report["generation_busy_frac"] = round(sum(r["time/generate_s"] for r in steady) / total, 3)
    report["learning_busy_frac"] = round(sum(r["time/learn_s"] for r in steady) / total, 3)
  for line in result.stdout.splitlines():
    if "held-out accuracy:" in line:
      report["eval"] = line.split("held-out accuracy:")[1].strip()
  return report


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--cpu-devices", type=int, default=2)
  parser.add_argument("--max-staleness", type=int, default=1)
  parser.add_argument("--skip", type=int, default=5, help="first steps left out (compilation)")
  parser.add_argument("--tail", type=int, default=20, help="last steps the final reward averages")
  parser.add_argument("--workdir", type=pathlib.Path, default=None)
  parser.add_argument("overrides", nargs="*", help="more --config.a.b=value overrides")
  args = parser.parse_args()
  workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="rlx-deployment-"))
  first = workdir / "split"
  results = {"split": _run("split", first, args, args.overrides)}
  warm = [f"--config.model.path={first / 'warmup'}", "--config.trainer.warmup_sft_steps=0"]
  results["colocated"] = _run("colocated", workdir / "colocated", args, args.overrides + warm)
  results["split_over_colocated_samples_per_s"] = round(
      results["split"]["samples_per_s"] / results["colocated"]["samples_per_s"], 3)
  results["config"] = {"steps": args.steps, "cpu_devices": args.cpu_devices,
                       "max_staleness": args.max_staleness, "overrides": args.overrides}
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  main()
