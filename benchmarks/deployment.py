"""Colocated (one process or two) vs split (one process) vs split as two jobs, on the same
work: samples/s, policy lag, busy fraction of each side, sync seconds and the held-out
accuracy reached, as JSON.

Every arm runs DAPO (with truncated importance sampling) from the same warmed-up model
(the warm-up runs once, in the first arm's workdir; the others load it with
``--config.model.path``), with the same data, seed, number of steps and staleness bound,
on the same two CPU cores, one arm after the other:

- ``colocated``: one process, 2 devices, both cores; generate then learn, in turn.
- ``processes``: colocated as 2 processes of 1 device each, joined by ``jax.distributed``
  (each runs on one core of its own); each samples half of every batch, and both join
  one data-parallel update over gloo.
- ``split``: one process, 2 devices (one generates, one learns), both cores, a thread each.
- ``stream``: ``split`` with continuous admission (``mesh.admission=continuous``): one
  generation stream, new prompts taking the slots finished samples leave.
- ``stream_release``: ``stream`` where an episode waiting for its environment leaves its slot
  (``env.release_slots``); episodes only.
- ``jobs``: a learner process and a generator process (``mesh.role``), 1 device each,
  each pinned to its own core with ``taskset`` when it exists (``--job-cores shared``: both
  on both cores, as a split process's two devices share them); they share the workdir.
- ``jobs_stream``: ``jobs`` with continuous admission in the generator job.

    python benchmarks/deployment.py --steps 150 [--arms colocated processes split jobs] \
        [--config configs/X.py] [--config.a.b=v ...]

Multi-turn agents, with a calculator that sleeps 0-2 s per call (``benchmarks/slow_calc.py``)::

    python benchmarks/deployment.py --config configs/agent_calc.py --arms colocated split \
        --steps 60 --config.env.name=benchmarks/slow_calc.py:make_env

For episodes it also reports the decode slots' occupancy (and the share of computed slots that
held a decoding sample), turns and tool calls per episode,
and the tool latency.

Busy fractions: each side's share of the loop's wall time spent working (generating, or
learning); colocated reports the share of wall time each phase holds the shared devices,
so there the two add up to at most 1.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import runs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pinned(cores: str) -> list[str]:
  return ["taskset", "-c", cores] if shutil.which("taskset") else []


def _command(workdir: pathlib.Path, args, *extra: str) -> list[str]:
  return [sys.executable, "-m", "rlx.main", "--config", args.config,
          "--workdir", str(workdir), f"--config.trainer.steps={args.steps}",
          f"--config.mesh.max_staleness={args.max_staleness}",
          "--config.trainer.eval_every=0", "--config.logging.progress_bar=false",
          "--config.logging.tensorboard=false", "--config.checkpoint.every_steps=0",
          *args.overrides, *extra]


def _processes(arm: str, workdir: pathlib.Path, args, warm: list[str]) -> list[list[str]]:
  if arm == "colocated":
    return [_pinned("0,1") + _command(workdir, args, "--config.mesh.mode=colocated",
                                      "--config.mesh.cpu_devices=2", *warm)]
  if arm in ("split", "stream", "stream_release"):
    admission = "batch" if arm == "split" else "continuous"
    release = ["--config.env.release_slots=true"] if arm == "stream_release" else []
    return [_pinned("0,1") + _command(workdir, args, "--config.mesh.mode=split",
                                      "--config.mesh.cpu_devices=2",
                                      f"--config.mesh.admission={admission}", *release, *warm)]
  if arm == "processes":
    with socket.socket() as s:
      s.bind(("localhost", 0))
      port = s.getsockname()[1]
    return [["env", f"JAX_COORDINATOR_ADDRESS=localhost:{port}", "JAX_NUM_PROCESSES=2",
             f"JAX_PROCESS_ID={i}"]
            + _command(workdir, args, "--config.mesh.mode=colocated",
                       "--config.mesh.cpu_devices=1", "--config.mesh.multihost=true", *warm)
            for i in range(2)]
  jobs = ["--config.mesh.mode=split", "--config.mesh.cpu_devices=1",
          "--config.mesh.weight_sync=orbax", *warm]
  if arm == "jobs_stream":
    jobs.append("--config.mesh.admission=continuous")
  own = args.job_cores == "own"
  return [_pinned("0" if own else "0,1") + _command(workdir, args, *jobs,
                                                    "--config.mesh.role=learner"),
          _pinned("1" if own else "0,1") + _command(workdir, args, *jobs,
                                                    "--config.mesh.role=generator")]


def _run(arm: str, workdir: pathlib.Path, args, warm: list[str]) -> dict:
  started = time.perf_counter()
  processes = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
               for command in _processes(arm, workdir, args, warm)]
  try:
    outputs = [p.communicate(timeout=args.timeout_s) for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  wall = time.perf_counter() - started
  for p, (out, err) in zip(processes, outputs):
    if p.returncode:
      raise SystemExit(f"{arm} run failed:\n{out[-2000:]}\n{err[-4000:]}")
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steady = rows[args.skip:]  # the first steps compile
  step_s = [r["time/step_s"] for r in steady]
  total = sum(step_s)
  samples = sum(r["throughput/samples_per_s"] * r["time/step_s"] for r in steady)
  tail = rows[-args.tail:]
  report = {
      "steps": len(rows), "process_wall_s": round(wall, 1),
      "samples_per_s": round(samples / total, 2),
      "step_s_median": round(statistics.median(step_s), 4),
      "policy_lag_mean": round(statistics.mean(r["rollout/policy_lag_mean"] for r in steady), 3),
      "policy_lag_max": max(r["rollout/policy_lag_max"] for r in rows),
      "sync_s_median": round(statistics.median(r["time/sync_s"] for r in steady), 5),
      "final_reward_mean": round(statistics.mean(r["reward/mean"] for r in tail), 4),
      "final_train_accuracy": round(statistics.mean(r["reward/accuracy"] for r in tail), 4),
  }
  if arm in ("split", "stream", "stream_release"):
    report["generation_busy_frac"] = round(rows[-1]["time/generation_busy_frac"], 3)
    report["learning_busy_frac"] = round(rows[-1]["time/learning_busy_frac"], 3)
    report["dropped_batches"] = rows[-1]["rollout/dropped_batches"]
  else:  # from each step's own timings
    report["generation_busy_frac"] = round(sum(r["time/generate_s"] for r in steady) / total, 3)
    report["learning_busy_frac"] = round(sum(r["time/learn_s"] for r in steady) / total, 3)
  if arm in ("jobs", "jobs_stream"):
    report["generator_sync_s_median"] = round(
        statistics.median(r["time/generator_sync_s"] for r in steady), 5)
    report["dropped_batches"] = rows[-1]["rollout/dropped_batches"]
  if "rollout/slot_occupancy" in rows[-1]:  # episodes, or a stream: means over the steps
    for key in ("rollout/slot_occupancy", "rollout/slots_held_frac", "rollout/version_span_mean", "rollout/groups_in_flight", "agent/turns_mean", "agent/tool_calls_mean",
                "time/all_slots_parked_s", "agent/tool_latency_p50_s",
                "agent/tool_latency_p90_s", "agent/tool_wait_mean_s", "rollout/dropped_groups"):
      values = [r[key] for r in steady if key in r]
      if values:
        report[key.split("/", 1)[1]] = round(statistics.mean(values), 4)
  measured = runs.accuracy(outputs[0][0])
  if measured:
    report["eval_accuracy_before"], report["eval_accuracy_after"] = measured
  return report


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--config", default="configs/dapo_split.py",
                      help="the config every arm runs (its mesh mode is the arm's)")
  arms = ["colocated", "processes", "split", "stream", "jobs"]
  parser.add_argument("--arms", nargs="+", default=arms, choices=[*arms, "stream_release", "jobs_stream"])
  parser.add_argument("--max-staleness", type=int, default=1)
  parser.add_argument("--skip", type=int, default=5, help="first steps left out (compilation)")
  parser.add_argument("--tail", type=int, default=20, help="last steps the final reward averages")
  parser.add_argument("--job-cores", choices=["own", "shared"], default="own",
                      help="jobs arms: each job pinned to a core of its own, or both jobs on "
                           "both cores (as the two devices of a split process share them)")
  parser.add_argument("--timeout-s", type=int, default=3600, help="per arm")
  parser.add_argument("--workdir", type=pathlib.Path, default=None)
  args = runs.parse_args(parser)
  workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="rlx-deployment-"))
  results, warm = {}, []
  for arm in args.arms:
    results[arm] = _run(arm, workdir / arm, args, warm)
    print(f"{arm}: {json.dumps(results[arm])}", file=sys.stderr, flush=True)
    if not warm and (workdir / arm / "warmup").is_dir():  # the first arm trained the warm-up:
      # the others start from it (none when every arm starts from --config.model.path)
      warm = runs.warm_start(workdir / arm)
  if "colocated" in results:
    for arm in list(results):
      if arm != "colocated":
        results[f"{arm}_over_colocated_samples_per_s"] = round(
            results[arm]["samples_per_s"] / results["colocated"]["samples_per_s"], 3)
  results["config"] = {"file": args.config, "steps": args.steps, "max_staleness": args.max_staleness,
                       "job_cores": args.job_cores,
                       "taskset": bool(shutil.which("taskset")), "overrides": args.overrides}
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  main()
