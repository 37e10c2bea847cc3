"""Held-out evaluation: greedy accuracy, and pass@n with sampling.

    metrics = evaluate(run, params)                 # {"eval/accuracy": ..., ...}
"""

from __future__ import annotations

import time

import jax
import numpy as np

from rlx import distributed
from rlx.config import RunConfig
from rlx.trainer.collect import generate_and_score
from rlx.trainer.run import Run


def evaluation_due(config: RunConfig, step: int, stopping: bool) -> bool:
  """Whether the loop evaluates after ``step`` (never once the run is stopping)."""
  every = config.trainer.eval_every
  return bool(every and step % every == 0 and not stopping)


def evaluate(run: Run, params) -> dict[str, float]:
  """Held-out metrics: ``eval/accuracy``, the share of eval prompts whose greedy answer is
  correct (a format bonus never counts); with ``trainer.eval_samples`` = n, also
  ``eval/pass@n`` (some sample of n correct) and ``eval/sampled_accuracy`` (the share of
  samples correct). Empty when there are no eval rows. With several processes, each answers
  its share of the prompts and the metrics are over all of them."""
  if not run.eval_rows:
    return {}
  started = time.perf_counter()
  count, index = jax.process_count(), jax.process_index()
  rows = run.eval_rows[index::count]
  n = run.config.trainer.eval_samples
  totals = np.zeros(3)  # greedy correct, prompts with a correct sample, correct samples
  if rows:
    _, scored = generate_and_score(run, params, rows, n=1, temperature=0.0, seed=0, version=0)
    totals[0] = np.sum(scored.correct)
    if n:
      completions, scored = generate_and_score(run, params, rows, n=n,
                                               temperature=run.config.rollout.temperature,
                                               seed=1, version=0)
      solved = np.zeros(len(rows), bool)
      for completion, correct in zip(completions, scored.correct):
        solved[completion.prompt_index] |= correct
      totals[1], totals[2] = solved.sum(), np.sum(scored.correct)
  totals = distributed.sum_over_processes(totals)
  run.seconds["evals"] = run.seconds.get("evals", 0.0) + time.perf_counter() - started
  prompts = len(run.eval_rows)
  metrics = {"eval/accuracy": float(totals[0] / prompts)}
  if n:
    metrics.update({f"eval/pass@{n}": float(totals[1] / prompts),
                    "eval/sampled_accuracy": float(totals[2] / (prompts * n))})
  return metrics
