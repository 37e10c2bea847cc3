"""What every part of the trainer shares: the errors that stop a run, how it speaks, and the
step metrics every deployment reports alike.

Building a run lives in ``rlx.trainer.setup.run``, drawing and scoring rollouts in
``rlx.trainer.produce.collect``, held-out evaluation in ``rlx.trainer.produce.evaluate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from rlx import distributed

Say = Callable[[str], None]
Evaluate = Callable[[Any, Any], dict]
"""``evaluate(run, params) -> {"eval/...": figure}``: the held-out evaluation, which the
producing side owns (``rlx.trainer.produce.evaluate``) and the learn side is handed."""


def due(every: int, step: int) -> bool:
  """Whether work done every ``every`` steps (0: never) is due after ``step``."""
  return bool(every) and step % every == 0


class TrainingError(RuntimeError):
  """The run cannot go on; the message says why, what to change and what is saved."""


class DynamicSamplingError(TrainingError):
  """DAPO's dynamic sampling could not fill a batch with groups of varied rewards."""


class RewardFailedError(TrainingError):
  """Every reward call failed, step after step (``reward.max_error_steps``)."""


class EpisodesFailedError(TrainingError):
  """No episode could run: every environment's reset, or every agent program, failed."""


class NonFiniteError(TrainingError):
  """Too many updates in a row had a non-finite loss or gradient norm."""


def device_memory() -> dict[str, float]:
  """``device/memory_in_use_gib`` and ``device/memory_peak_gib``: the fullest local device,
  where the backend reports memory (GPU, TPU); nothing on CPU."""
  stats = [d.memory_stats() for d in jax.local_devices()]
  stats = [s for s in stats if s and "bytes_in_use" in s]
  if not stats:
    return {}
  gib = 1024 ** 3
  return {"device/memory_in_use_gib": max(s["bytes_in_use"] for s in stats) / gib,
          "device/memory_peak_gib": max(s.get("peak_bytes_in_use", s["bytes_in_use"])
                                        for s in stats) / gib}


def throughput(draw, seconds: float) -> dict[str, float]:
  """``throughput/tokens_per_s`` (sampled tokens: an episode's environment tokens are not
  generated) and ``throughput/samples_per_s`` of a step that took ``seconds``, counting every
  process's share of the batch (call it on every process)."""
  tokens, samples = distributed.sum_over_processes(
      [sum(c.sampled_tokens for c in draw.completions), len(draw.completions)])
  return {"throughput/tokens_per_s": float(tokens) / seconds,
          "throughput/samples_per_s": float(samples) / seconds}
