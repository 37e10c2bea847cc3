"""Scoring responses in a pool of host worker processes, off the device path.

    with RewardPool("arithmetic", format_weight=0.1, num_workers=2, timeout_s=5) as pool:
        rewards, counts = pool.score(responses, references)

A reward function that raises scores 0; so does one that runs past
``timeout_s`` (its worker is replaced). Both are counted in ``counts``
(``reward/errors``, ``reward/timeouts``) and the first error of each kind is
logged; the run goes on. ``num_workers=0`` scores in the calling thread (no
timeouts), for debugging.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import time
from collections.abc import Sequence

import numpy as np

from rlx.rewards.verifiers import VERIFIERS, score

log = logging.getLogger(__name__)


class RewardPool:
  """A verifier applied to (response, reference) pairs in worker processes.

  ``verifier`` is a name in ``VERIFIERS`` or a module-level function
  ``(response, reference) -> float`` (workers import it by name).
  """

  def __init__(self, verifier, *, format_weight: float = 0.0, num_workers: int = 2,
               timeout_s: float = 5.0):
    if isinstance(verifier, str) and verifier not in VERIFIERS:
      raise ValueError(f"unknown reward {verifier!r}; choose one of {', '.join(VERIFIERS)}")
    self.verifier, self.format_weight = verifier, format_weight
    self.num_workers, self.timeout_s = num_workers, timeout_s
    self.totals = {"reward/errors": 0, "reward/timeouts": 0}
    self._executor = self._start() if num_workers else None

  def _start(self):
    # spawn, not fork: the parent runs JAX's threads, which fork does not copy safely.
    return concurrent.futures.ProcessPoolExecutor(
        self.num_workers, mp_context=multiprocessing.get_context("spawn"))

  def _restart(self):
    for process in list(getattr(self._executor, "_processes", {}).values()):
      process.kill()  # a worker stuck in a reward function never returns on its own
    self._executor.shutdown(wait=False, cancel_futures=True)
    self._executor = self._start()

  def score(self, responses: Sequence[str], references: Sequence[str]) -> tuple[np.ndarray, dict]:
    """Rewards [N] (float32) and this call's error and timeout counts."""
    if len(responses) != len(references):
      raise ValueError(f"{len(responses)} responses but {len(references)} references")
    counts = {"reward/errors": 0, "reward/timeouts": 0}
    rewards = np.zeros(len(responses), np.float32)
    if self._executor is None:
      for i, (response, reference) in enumerate(zip(responses, references)):
        try:
          rewards[i] = score(self.verifier, self.format_weight, response, reference)
        except Exception as error:  # noqa: BLE001 - any reward failure scores 0
          self._count_error(counts, error)
    else:
      futures = [self._executor.submit(score, self.verifier, self.format_weight, r, ref)
                 for r, ref in zip(responses, references)]
      deadline = time.monotonic() + self.timeout_s + 0.05 * len(futures)
      timed_out = False
      for i, future in enumerate(futures):
        try:
          rewards[i] = future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except concurrent.futures.TimeoutError:
          counts["reward/timeouts"] += 1
          timed_out = True
        except concurrent.futures.process.BrokenProcessPool as error:
          self._count_error(counts, error)
          timed_out = True
        except Exception as error:  # noqa: BLE001
          self._count_error(counts, error)
      if timed_out:
        if counts["reward/timeouts"] and not self.totals["reward/timeouts"]:
          log.warning("a reward call ran past %.1fs and scored 0; its worker was replaced",
                      self.timeout_s)
        self._restart()
    for key, value in counts.items():
      self.totals[key] += value
    return rewards, counts

  def _count_error(self, counts: dict, error: BaseException) -> None:
    if not self.totals["reward/errors"] and not counts["reward/errors"]:
      log.warning("a reward function raised %s: %s; it scores 0 (further errors are only counted)",
                  type(error).__name__, error)
    counts["reward/errors"] += 1

  def close(self) -> None:
    if self._executor is not None:
      self._executor.shutdown(wait=True, cancel_futures=True)
      self._executor = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
