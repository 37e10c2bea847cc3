"""Several tinker-cookbook RL loops at once against one rlx Tinker service: does each learn?

    python benchmarks/tinker_clients.py [--model models/SmolLM2-135M-Instruct]
        [--runs word_sums:0,word_sums:1,word_groups:0,word_groups:1] [--steps 20]
        [--eval-prompts 100] [--workdir runs/tinker_clients]

Starts ``python -m rlx.tinker`` once, then one ``benchmarks/tinker_cookbook_rl.py`` process
per ``TASK:SEED`` of ``--runs``, all at once, each with ``--base-url`` pointing at the one
service: each is a training client (a LoRA adapter with its own Adam state on the shared base)
running tinker-cookbook's own RL loop, unchanged, with its held-out greedy evaluation before
and after. The service decodes their sampling calls together (each slot with its own client's
adapter) and runs their training calls one after another. Needs the cookbook's environment
(see ``tinker_cookbook_rl.py``). Prints one JSON object: each run's accuracy before and after,
its steps, median step and wall time, and the service's log lines about sampling batches.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from tinker_cookbook_rl import start_service, stop_service  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
  parser.add_argument("--runs", default="word_sums:0,word_sums:1,word_groups:0,word_groups:1")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--eval-prompts", type=int, default=100)
  parser.add_argument("--learning-rate", type=float, default=2e-4)
  parser.add_argument("--workdir", default="runs/tinker_clients")
  args = parser.parse_args()
  workdir = pathlib.Path(args.workdir).resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  service, url = start_service(str(pathlib.Path(args.model).resolve()), workdir, sys.executable)
  runs = [tuple(run.split(":")) for run in args.runs.split(",")]
  started = time.perf_counter()
  try:
    processes = {}
    for task, seed in runs:
      name = f"{task}_seed{seed}"
      command = [sys.executable, str(REPO / "benchmarks/tinker_cookbook_rl.py"),
                 "--model", args.model, "--task", task, "--seed", seed,
                 "--steps", str(args.steps), "--eval-prompts", str(args.eval_prompts),
                 "--learning-rate", str(args.learning_rate), "--base-url", url,
                 "--workdir", str(workdir / name)]
      processes[name] = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                         stderr=open(workdir / f"{name}.err", "w"), text=True)
    results = {}
    for name, process in processes.items():
      out, _ = process.communicate()
      if process.returncode:
        raise SystemExit(f"{name} exited with {process.returncode}: see {workdir}/{name}.err")
      results[name] = json.loads(out)
  finally:
    stop_service(service)
  wall = time.perf_counter() - started
  batches = [line for line in (workdir / "service.log").read_text().splitlines()
             if "tinker: sampled" in line]
  shared = [line for line in batches if " on 1 sampler(s)" not in line]
  print(json.dumps({
      "runs": {name: {key: r[key] for key in ("accuracy_before", "accuracy_after", "gain_points",
                                              "steps", "median_step_s", "train_minutes",
                                              "reward_first_last")}
               for name, r in results.items()},
      "wall_minutes": round(wall / 60, 1),
      "sampling_batches": len(batches),
      "batches_of_several_samplers": len(shared),
  }, indent=1))


if __name__ == "__main__":
  main()
