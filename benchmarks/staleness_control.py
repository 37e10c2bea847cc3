"""The staleness controller against a deliberately slow learner, side by side with the same run
without it: policy lag, the effective k, expired batches and samples/s, as JSON; and the
run report of both (``--report DIR``).

Both arms run ``configs/dapo_split.py`` in one process (a generator thread and a learner
thread) with ``mesh.max_staleness`` = K, the learner slowed by ``--learner-delay`` seconds a
step so that the generator runs K versions ahead:

- ``fixed``: no controller; the lag sits at K;
- ``controlled``: ``mesh.lag_threshold`` = T; batches older than T versions are expired, and
  the controller steps k down until the lag is back under T.

    python benchmarks/staleness_control.py --steps 40 --report /tmp/rlx-control [--config.a.b=v ...]

The second arm starts from the first arm's warm-up (the warm-up runs once).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import runs

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--learner-delay", type=float, default=2.0,
                      help="seconds the learner sleeps after each update")
  parser.add_argument("--max-staleness", type=int, default=3)
  parser.add_argument("--lag-threshold", type=int, default=1)
  parser.add_argument("--window", type=int, default=3, help="mesh.control_window")
  parser.add_argument("--workdir", default=None, help="default: a temporary directory")
  parser.add_argument("--report", default=None, help="write the run report of both arms here")
  args = runs.parse_args(parser)

  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  from rlx import cli
  from rlx.config import check
  from rlx.main import write_config
  from rlx.trainer import train_split

  root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="rlx-control-"))
  common = ["--config.logging.progress_bar=false", f"--config.trainer.steps={args.steps}",
            f"--config.mesh.max_staleness={args.max_staleness}",
            f"--config.mesh.control_window={args.window}", "--config.trainer.eval_every=0",
            "--config.checkpoint.every_steps=0", *args.overrides]
  arms = {"fixed": [], "controlled": [f"--config.mesh.lag_threshold={args.lag_threshold}"]}
  results = {}
  for i, (arm, extra) in enumerate(arms.items()):
    workdir = root / arm
    warm = runs.warm_start(root / "fixed") if i else []
    config = check(cli.apply_overrides(
        cli.load_config_file(str(ROOT / "configs" / "dapo_split.py")),
        (*common, *warm, *extra)))
    write_config(config, workdir)  # the report reads the bound and the threshold from it
    said: list[str] = []
    started = time.perf_counter()
    summary = train_split(config, workdir, learner_delay_s=args.learner_delay,
                          say=lambda line, said=said: (said.append(line), print(line)))
    seconds = time.perf_counter() - started
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    lags = [row["rollout/policy_lag_mean"] for row in rows]
    quarter = max(1, len(rows) // 4)
    results[arm] = {
        "workdir": str(workdir), "steps": len(rows),
        "policy_lag_mean_first_quarter": statistics.mean(lags[:quarter]),
        "policy_lag_mean_last_quarter": statistics.mean(lags[-quarter:]),
        "policy_lag_max_last_quarter": max(r["rollout/policy_lag_max"] for r in rows[-quarter:]),
        "k_by_step": [r.get("control/k", args.max_staleness) for r in rows],
        "expired_batches": summary.get("expired_batches", 0),
        "control_events": summary.get("control_events", []),
        "samples_per_s": statistics.median(r["throughput/samples_per_s"] for r in rows),
        "loop_seconds": summary.seconds["RL loop"], "wall_seconds": seconds,
        "eval_accuracy_after": summary.eval_accuracy_after}
  if args.report:
    from rlx import report
    results["report"] = str(report.write_report([root / arm for arm in arms], args.report))
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
