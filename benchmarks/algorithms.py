"""The algorithms' presets and DAPO's entropy tools on the built-in task, on the same
budget: held-out greedy accuracy, pass@8, final entropy and time per step (mean ± std over
seeds), as JSON.

Every run has the same number of RL steps, prompts per step, samples per prompt and
optimizer steps per rollout batch (``trainer.mini_batches``), colocated (always
on-policy), as separate ``python -m rlx.main`` processes one after the other. For each
seed, every run starts from the same warmed-up model (the seed's first run trains it, the
others load it) and is evaluated on the same held-out prompts; the seed also sets the data
order and sampling.

    python benchmarks/algorithms.py --steps 200 --seeds 0 1 2 [--config.a.b=value ...]
    python benchmarks/algorithms.py --model models/SmolLM2-135M-Instruct --steps 10 --seeds 0 \
        --algorithms grpo dr_grpo gspo cispo dapo --eval-prompts 200 --eval-samples 1

With ``--model DIR`` the runs start from that pretrained model with the real-model recipe
(``configs/smollm2_math.py``: its task, reward, chat template, learning rate, batch and
lengths), colocated, no warm-up, and the presets on top; DAPO's overlong filter is off there
(the recipe's 32-token answers are cut by design, and the filter would mask nearly every
sample). The table on the built-in model says nothing about real models.

The presets run with their papers' values (``rlx.config.algorithm.PRESETS``); each run
names only what is not the preset's:

- ``dapo``: clip-higher (0.2 / 0.28), token-level loss, dynamic sampling, overlong
  filtering and soft overlong punishment; no KL.
- ``grpo``: group-normalised advantages, clip 0.2, sequence-mean of token-means, k3 KL to
  the reference (0.04).
- ``dr_grpo``: no std, the constant normaliser (the generation budget); no KL.
- ``gspo``: the sequence-level ratio, clip 3e-4 / 4e-4, sequence-mean.
- ``cispo``: the clipped IS weight (upper bound 5, none below), token-level.
- ``dapo+clip_cov``, ``dapo+kl_cov``: DAPO with Clip-Cov / KL-Cov on 2% of the tokens
  (the papers' 2e-4 .. 2e-3 select no token of a batch this small).
- ``dapo+top_entropy``: DAPO training only the top 20% highest-entropy tokens.
- ``dapo+adaptive_entropy``: DAPO with Skywork-OR1's adaptive entropy coefficient
  (target 0.7, step 0.005 per batch).
- ``dapo+entropy_floor``: DAPO with rlx's entropy-floor controller (floor 0.7, raising the
  sampling temperature).

The entropy targets sit above DAPO's own entropy at the end of a short run, so that the
tools act within it; below it they never engage and the runs equal plain DAPO.

A DAPO step draws more prompts than the others when dynamic sampling drops groups: its time
per step includes that extra generation (``draws_per_step_mean``).
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

import runs

ROOT = pathlib.Path(__file__).resolve().parent.parent

_DAPO = ["--config.algorithm.name=dapo", "--config.algorithm.dynamic_sampling=true",
         "--config.algorithm.dynamic_sampling_max_draws=32",
         "--config.algorithm.overlong_filter=true", "--config.algorithm.overlong_buffer=4",
         "--config.algorithm.kl_coef=0"]

ALGORITHMS = {
    "dapo": _DAPO,
    "grpo": ["--config.algorithm.name=grpo", "--config.algorithm.kl_coef=0.04",
             "--config.algorithm.kl_estimator=k3"],
    "dr_grpo": ["--config.algorithm.name=dr_grpo", "--config.algorithm.kl_coef=0"],
    "gspo": ["--config.algorithm.name=gspo", "--config.algorithm.kl_coef=0"],
    "cispo": ["--config.algorithm.name=cispo", "--config.algorithm.kl_coef=0"],
    "dapo+clip_cov": [*_DAPO, "--config.algorithm.policy_loss=clip_cov",
                      "--config.algorithm.cov_ratio=0.02"],
    "dapo+kl_cov": [*_DAPO, "--config.algorithm.policy_loss=kl_cov",
                    "--config.algorithm.cov_ratio=0.02"],
    "dapo+top_entropy": [*_DAPO, "--config.algorithm.top_entropy_quantile=0.2"],
    # targets above DAPO's entropy at the end of a short run (about 0.57 at 60 steps), so that
    # both act within it
    "dapo+adaptive_entropy": [*_DAPO, "--config.algorithm.entropy_target=0.7",
                              "--config.algorithm.entropy_coef_step=0.005"],
    "dapo+entropy_floor": [*_DAPO, "--config.algorithm.entropy_floor=0.7"],
}


def _base(args) -> list[str]:
  """The config the presets go on: the built-in model and task, or a pretrained model with
  the real-model recipe."""
  if args.model is None:
    return ["--config", "configs/base.py"]
  return ["--config", "configs/smollm2_math.py", f"--config.model.path={args.model}",
          "--config.trainer.eval_every=0"]


def _preset(algorithm: str, args) -> list[str]:
  flags = ALGORITHMS[algorithm]
  if args.model is not None:  # the recipe cuts answers at 32 tokens on purpose
    flags = [f for f in flags if not f.startswith("--config.algorithm.overlong_")]
    flags += ["--config.algorithm.overlong_filter=false"] if algorithm.startswith("dapo") else []
  return flags


def _run(algorithm: str, seed: int, workdir: pathlib.Path, args, warm: list[str]) -> dict:
  command = [sys.executable, "-m", "rlx.main", *_base(args),
             "--workdir", str(workdir), "--config.mesh.mode=colocated",
             "--config.algorithm.off_policy=none",
             f"--config.mesh.cpu_devices={args.cpu_devices}", f"--config.trainer.steps={args.steps}",
             f"--config.trainer.mini_batches={args.mini_batches}",
             f"--config.trainer.eval_prompts={args.eval_prompts}",
             f"--config.trainer.eval_samples={args.eval_samples}",
             f"--config.trainer.seed={seed}", f"--config.data.shuffle_seed={seed}",
             f"--config.model.seed={seed}", "--config.trainer.eval_every=0",
             "--config.logging.progress_bar=false", "--config.logging.tensorboard=false",
             "--config.checkpoint.every_steps=0", *_preset(algorithm, args), *args.overrides,
             *warm]
  started = time.perf_counter()
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - started
  if result.returncode:
    raise SystemExit(f"{algorithm} (seed {seed}) failed:\n{result.stdout[-2000:]}\n"
                     f"{result.stderr[-4000:]}")
  measured = runs.accuracy(result.stdout)
  if measured is None:
    raise SystemExit(f"{algorithm} (seed {seed}): no held-out accuracy in its output:\n"
                     f"{result.stdout[-2000:]}")
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  final = json.loads((workdir / "eval_final.json").read_text())
  steady = rows[args.skip:]  # the first steps compile
  return {
      "before": measured[0], "after": measured[1],
      "pass_at_k": final.get(f"eval/pass@{args.eval_samples}", float("nan")),
      "entropy_last": statistics.mean(r["policy/entropy"] for r in rows[-args.tail:]),
      "step_s_median": statistics.median(r["time/step_s"] for r in steady),
      "draws_mean": statistics.mean(r["rollout/draws"] for r in rows),
      "clip_frac_high_mean": statistics.mean(r["policy/clip_frac_high"] for r in rows),
      "train_accuracy_last": statistics.mean(r["reward/accuracy"] for r in rows[-args.tail:]),
      "process_wall_s": wall,
  }


def _mean_std(values: list[float]) -> dict:
  return {"mean": round(statistics.mean(values), 4),
          "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
  parser.add_argument("--mini-batches", type=int, default=2)
  parser.add_argument("--eval-prompts", type=int, default=500)
  parser.add_argument("--eval-samples", type=int, default=8, help="n of the final pass@n")
  parser.add_argument("--cpu-devices", type=int, default=2)
  parser.add_argument("--skip", type=int, default=5, help="first steps left out (compilation)")
  parser.add_argument("--tail", type=int, default=20, help="last steps the train accuracy averages")
  parser.add_argument("--workdir", type=pathlib.Path, default=None)
  parser.add_argument("--model", default=None,
                      help="a pretrained model's directory: the real-model recipe's runs")
  args = runs.parse_args(parser)
  workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="rlx-algorithms-"))
  results_by: dict[str, list[dict]] = {name: [] for name in args.algorithms}
  for seed in args.seeds:
    warm: list[str] = []
    for name in args.algorithms:
      directory = workdir / f"seed{seed}" / name
      results_by[name].append(_run(name, seed, directory, args, warm))
      print(f"{name} seed {seed}: {json.dumps(results_by[name][-1])}", file=sys.stderr,
            flush=True)
      if not warm and args.model is None:  # the seed's first run trained the warm-up
        warm = runs.warm_start(directory)
  results = {}
  for name, per_seed in results_by.items():
    results[name] = {
        "eval_accuracy_after": _mean_std([r["after"] for r in per_seed]),
        "eval_gain_points": _mean_std([100 * (r["after"] - r["before"]) for r in per_seed]),
        f"eval_pass@{args.eval_samples}": _mean_std([r["pass_at_k"] for r in per_seed]),
        "entropy_last_steps": _mean_std([r["entropy_last"] for r in per_seed]),
        "step_s_median": round(statistics.median(r["step_s_median"] for r in per_seed), 4),
        "draws_per_step_mean": round(statistics.mean(r["draws_mean"] for r in per_seed), 3),
        "clip_frac_high_mean": round(statistics.mean(r["clip_frac_high_mean"] for r in per_seed), 4),
        "train_accuracy_last_steps": _mean_std([r["train_accuracy_last"] for r in per_seed]),
        "per_seed_after": [round(r["after"], 4) for r in per_seed],
    }
  results["eval_accuracy_before"] = [round(r["before"], 4)
                                     for r in results_by[args.algorithms[0]]]
  results["config"] = {"steps": args.steps, "seeds": args.seeds, "mini_batches": args.mini_batches,
                       "eval_prompts": args.eval_prompts,
                       "eval_samples": args.eval_samples, "cpu_devices": args.cpu_devices,
                       "mode": "colocated", "model": args.model or "built-in",
                       "overrides": args.overrides}
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  main()
