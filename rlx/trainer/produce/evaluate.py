"""Held-out evaluation: greedy accuracy, and pass@k with sampling.

    metrics = evaluate(run, params)                 # {"eval/accuracy": ..., ...}
"""

from __future__ import annotations

import jax
import numpy as np

from rlx import distributed
from rlx.trainer.produce.collect import generate_and_score
from rlx.trainer.setup.run import Run


def pass_at_k(n: int, correct: np.ndarray, k: int) -> np.ndarray:
  """The unbiased pass@k estimate of each prompt from ``n`` samples of which ``correct`` [P]
  are right (Chen et al. 2021, arXiv 2107.03374): ``1 - C(n - c, k) / C(n, k)``, as the
  stable product ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``."""
  if not 1 <= k <= n:
    raise ValueError(f"pass@{k} needs 1 <= k <= n = {n}")
  correct = np.asarray(correct, np.int64)
  out = np.ones(len(correct))
  for p, c in enumerate(correct):
    if n - c >= k:
      out[p] = 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))
  return out


def pass_ks(n: int) -> list[int]:
  """The k reported for n samples: 1, 2, 4, ... up to n, and n."""
  ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
  return ks if ks[-1] == n else ks + [n]


def evaluate(run: Run, params) -> dict[str, float]:
  """Held-out metrics: ``eval/accuracy``, the share of eval prompts whose greedy answer is
  correct (a format bonus never counts); with ``trainer.eval_samples`` = n, also
  ``eval/pass@k`` for k = 1, 2, 4, ..., n (the unbiased estimate from the n samples at
  ``rollout.temperature``: the chance that some of k samples is correct) and
  ``eval/sampled_accuracy`` (the share of samples correct, = pass@1). Multi-turn episodes
  also give ``eval/turns_mean`` and ``eval/tool_calls_mean`` of the greedy episodes. Empty
  when there are no eval rows. With several processes, each answers its share of the prompts and the metrics
  are over all of them."""
  if not run.eval_rows:
    return {}
  count, index = jax.process_count(), jax.process_index()
  rows = run.eval_rows[index::count]
  n = run.config.trainer.eval_samples
  ks = pass_ks(n) if n else []
  # greedy correct, the greedy episodes' count, turns and tool calls, correct samples, pass@k
  totals = np.zeros(5 + len(ks))
  if rows:
    _, scored = generate_and_score(run, params, rows, n=1, temperature=0.0, seed=0, version=0)
    totals[0] = np.sum(scored.correct)
    totals[1:4] = [scored.counts.get(f"agent:{key}", 0.0)
                   for key in ("episodes", "turns", "tool_calls")]
    if n:
      completions, scored = generate_and_score(run, params, rows, n=n,
                                               temperature=run.config.rollout.temperature,
                                               seed=1, version=0)
      right = np.zeros(len(rows), np.int64)
      for completion, correct in zip(completions, scored.correct):
        right[completion.prompt_index] += bool(correct)
      totals[4] = right.sum()
      totals[5:] = [pass_at_k(n, right, k).sum() for k in ks]
  totals = distributed.sum_over_processes(totals)
  prompts = len(run.eval_rows)
  metrics = {"eval/accuracy": float(totals[0] / prompts)}
  if totals[1]:
    metrics["eval/turns_mean"] = float(totals[2] / totals[1])
    metrics["eval/tool_calls_mean"] = float(totals[3] / totals[1])
  if n:
    metrics["eval/sampled_accuracy"] = float(totals[4] / (prompts * n))
    metrics.update({f"eval/pass@{k}": float(total / prompts) for k, total in zip(ks, totals[5:])})
  return metrics
