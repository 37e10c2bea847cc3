"""Closed-loop control of a split run: the staleness bound k and the sampling knob that holds
entropy up, decided from the metrics the loop already measures.

    control = Controller.from_config(config)
    control.verdict(lag_max, age_s)          # -> TRAIN | DROP | EXPIRE: what the learner does
    events = control.observe(step, lag_mean=..., is_clip_frac=..., entropy=...)
    control.k, control.temperature, control.clip_eps_high   # the knobs' current values
    control.metrics()                        # {"control/k": ..., ...}

Every decision here is a pure function of the observations fed in (no clocks, no
threads), so tests drive it with synthetic metric streams, and every process of a
multi-process job, fed the same replicated metrics, decides the same.

**Staleness.** ``mesh.max_staleness`` is the most k may ever be (how far ahead the
generator may run). The controller holds an effective k in ``[0, max_staleness]``:

- it lowers k by one when, over the last ``mesh.control_window`` batches received
  (trained or expired), the mean policy lag exceeds ``mesh.lag_threshold``, or the mean
  fraction of tokens whose behaviour importance weight exceeds ``algorithm.tis_cap``
  exceeds ``algorithm.max_is_clip_frac``;
- it raises k by one when, over a window, the lag would stay within the threshold one
  version later (mean lag + 1 <= threshold) and the clip fraction is under half its limit;
- after a change it waits a whole window of new batches before the next, so that each
  decision sees the effect of the last.

**Verdicts.** This module is the one place that decides whether data is too stale; the
learner loop, the generator's gate, the replay buffer and the generator job all ask it:

- a batch holding a rollout more than ``mesh.max_staleness`` versions behind the learner is
  *dropped* (``rollout/dropped_batches``): the generator's gate makes that impossible, so a
  drop means the gate was bypassed, and the check is the guarantee; so is a batch holding a
  rollout *ahead* of the learner (a negative lag: sampled with a version a stopped run wrote
  after the checkpoint this one resumed from);
- a batch whose largest lag exceeds ``mesh.lag_threshold``, or that was sampled longer than
  ``data.max_age_s`` seconds ago, is *expired* (``rollout/expired_batches``); independent
  of k, this is what keeps data the learner would be hurt by out of the update;
- anything else is trained on.

**Entropy floor.** When the mean ``policy/entropy`` over a window falls below
``algorithm.entropy_floor``, the controller raises the knob ``algorithm.entropy_control``
names, one step up: the sampling temperature within ``[rollout.temperature,
rollout.temperature_max]``, or the upper clip range within ``[algorithm.clip_eps_high,
algorithm.clip_eps_high_max]``, each range crossed in ``KNOB_STEPS`` equal steps (so the
learner compiles at most ``KNOB_STEPS + 1`` variants of its programs). When the mean
entropy is back above the floor by ``RECOVERED`` (a quarter), it lowers the knob one step.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from rlx.config import RunConfig

KNOB_STEPS = 4
"""Steps from a knob's base value to its maximum."""
RECOVERED = 1.25
"""Entropy counts as recovered at this multiple of the floor (hysteresis: no flapping)."""

TRAIN, DROP, EXPIRE = "train", "drop", "expire"
"""The verdicts on a batch (see the module docstring)."""


def bound(config: RunConfig) -> int:
  """The most versions any rollout may lag the learner: ``mesh.max_staleness`` (how far
  ahead a generator may run, and how many policy versions a reader may still need)."""
  return config.mesh.max_staleness


def lag(policy_versions, version: int) -> tuple[float, int]:
  """(mean, max) lag, in policy versions, of rollouts sampled at ``policy_versions`` were
  the learner to train on them at ``version``."""
  lags = version - np.asarray(policy_versions)
  return float(np.mean(lags)), int(np.max(lags))


def token_lag(completions, version: int) -> float:
  """The mean lag of the sampled tokens (``lag`` takes each row at its oldest token's
  version): below it when in-flight updates reached sequences while they decoded."""
  lags = [version - v for c in completions
          for v, sampled in zip(c.versions(), c.sampled_mask or [True] * len(c.response_tokens))
          if sampled]
  return float(np.mean(lags)) if lags else 0.0


def may_start(index: int, finished: int, k: int) -> bool:
  """The generator's gate: whether batch ``index`` (counting from 0 over the run) may start
  when the learner is done with ``finished`` batches (trained or dropped) under the bound
  ``k``. It samples with the newest version published when it starts, and every batch
  between raises the version by at most one, so its oldest token is at most k versions old
  when the learner trains on it, whatever was dropped before it."""
  return finished >= index - k


def admitted_groups(config: RunConfig, k: int) -> int:
  """The most groups the gate lets be sampled ahead at bound ``k``: ``may_start`` lets batch
  ``finished + k`` start, so k + 1 batches of ``data.prompts_per_step`` groups."""
  return (k + 1) * config.data.prompts_per_step


def groups_in_flight(config: RunConfig) -> int:
  """A stream's bound on groups admitted and not yet handed over: ``mesh.groups_in_flight``,
  or (0) one batch and twice what the slots hold: the next batch's groups take the slots the
  current one's stragglers leave (a bound of one batch would be the batch barrier again). The
  gate caps it further at ``admitted_groups``."""
  if config.mesh.groups_in_flight:
    return config.mesh.groups_in_flight
  slots_worth = -(-config.rollout.max_slots // config.rollout.group_size)
  return config.data.prompts_per_step + 2 * slots_worth


def past_bound(lag_max: int, max_staleness: int) -> bool:
  """Whether a batch whose largest lag is ``lag_max`` breaks the bound k = ``max_staleness``."""
  return lag_max > max_staleness


@dataclasses.dataclass(frozen=True)
class Event:
  """One change of a knob."""

  step: int
  knob: str
  old: float
  new: float
  reason: str

  def __str__(self) -> str:
    return f"step {self.step}: control/{self.knob} {self.old:g} -> {self.new:g} ({self.reason})"


class Staleness:
  """The effective staleness bound k (see the module docstring)."""

  def __init__(self, max_staleness: int, lag_threshold: int | None,
               max_is_clip_frac: float | None, window: int):
    self.k = self.max_k = max_staleness
    self.lag_threshold, self.max_is_clip_frac, self.window = lag_threshold, max_is_clip_frac, window
    self._lags: collections.deque[float] = collections.deque(maxlen=window)
    self._clips: collections.deque[float] = collections.deque(maxlen=window)

  @property
  def active(self) -> bool:
    return self.lag_threshold is not None or self.max_is_clip_frac is not None

  def observe(self, step: int, lag_mean: float, is_clip_frac: float | None) -> Event | None:
    """One batch received: its mean lag, and (when trained) its IS clip fraction."""
    if not self.active:
      return None
    self._lags.append(lag_mean)
    if is_clip_frac is not None:
      self._clips.append(is_clip_frac)
    if len(self._lags) < self.window:
      return None
    lag = sum(self._lags) / len(self._lags)
    clip = sum(self._clips) / len(self._clips) if self._clips else 0.0
    too_stale = self.lag_threshold is not None and lag > self.lag_threshold
    too_clipped = self.max_is_clip_frac is not None and clip > self.max_is_clip_frac
    if (too_stale or too_clipped) and self.k > 0:
      reason = (f"mean lag {lag:.2f} > mesh.lag_threshold={self.lag_threshold}" if too_stale else
                f"IS clip fraction {clip:.3f} > algorithm.max_is_clip_frac={self.max_is_clip_frac}")
      return self._change(step, self.k - 1, reason)
    healthy = ((self.lag_threshold is None or lag + 1 <= self.lag_threshold)
               and (self.max_is_clip_frac is None or clip <= self.max_is_clip_frac / 2))
    if healthy and self.k < self.max_k:
      return self._change(step, self.k + 1, f"healthy: mean lag {lag:.2f}, IS clip fraction "
                                            f"{clip:.3f}")
    return None

  def _change(self, step: int, k: int, reason: str) -> Event:
    event = Event(step, "k", self.k, k, reason)
    self.k = k
    self._lags.clear()  # the next decision sees only batches under the new k
    self._clips.clear()
    return event


class EntropyFloor:
  """The sampling knob that holds entropy above a floor (see the module docstring)."""

  def __init__(self, floor: float | None, knob: str, low: float, high: float, window: int):
    self.floor, self.knob, self.window = floor, knob, window
    self.levels = [low + (high - low) * i / KNOB_STEPS for i in range(KNOB_STEPS + 1)]
    self.level = 0
    self._entropy: collections.deque[float] = collections.deque(maxlen=window)

  @property
  def value(self) -> float:
    return self.levels[self.level]

  def observe(self, step: int, entropy: float) -> Event | None:
    if self.floor is None or not math.isfinite(entropy):
      return None
    self._entropy.append(entropy)
    if len(self._entropy) < self.window:
      return None
    mean = sum(self._entropy) / len(self._entropy)
    if mean < self.floor and self.level < KNOB_STEPS:
      return self._change(step, self.level + 1,
                          f"entropy {mean:.3f} < algorithm.entropy_floor={self.floor:g}")
    if mean >= self.floor * RECOVERED and self.level > 0:
      return self._change(step, self.level - 1,
                          f"entropy {mean:.3f} recovered (>= {RECOVERED:g} x the floor)")
    return None

  def _change(self, step: int, level: int, reason: str) -> Event:
    event = Event(step, self.knob, self.value, self.levels[level], reason)
    self.level = level
    self._entropy.clear()
    return event


class Controller:
  """The staleness and entropy controllers of one run, and the expiry rule."""

  def __init__(self, staleness: Staleness, entropy: EntropyFloor, *, temperature: float,
               clip_eps_high: float, lag_threshold: int | None, max_age_s: float | None):
    self.staleness, self.entropy = staleness, entropy
    self.max_staleness = staleness.max_k
    self._temperature, self._clip_eps_high = temperature, clip_eps_high
    self.lag_threshold, self.max_age_s = lag_threshold, max_age_s
    self.events: list[Event] = []

  @classmethod
  def from_config(cls, config: RunConfig) -> Controller:
    algo, rollout, mesh = config.algorithm, config.rollout, config.mesh
    window = mesh.control_window
    if algo.entropy_control == "temperature":
      low, high = rollout.temperature, rollout.temperature_max
    else:
      low, high = algo.eps_high, algo.clip_eps_high_max
    return cls(Staleness(mesh.max_staleness, mesh.lag_threshold, algo.max_is_clip_frac, window),
               EntropyFloor(algo.entropy_floor, algo.entropy_control, low, high, window),
               temperature=rollout.temperature, clip_eps_high=algo.eps_high,
               lag_threshold=mesh.lag_threshold, max_age_s=config.data.max_age_s)

  @property
  def k(self) -> int:
    return self.staleness.k

  @property
  def temperature(self) -> float:
    """The sampling temperature the generator should use now."""
    return self.entropy.value if self.entropy.knob == "temperature" else self._temperature

  @property
  def clip_eps_high(self) -> float:
    """The upper clip range the learner should use now."""
    return self.entropy.value if self.entropy.knob == "clip_eps_high" else self._clip_eps_high

  @property
  def expires(self) -> bool:
    """Whether batches can expire (a lag threshold or an age limit is set)."""
    return self.lag_threshold is not None or self.max_age_s is not None

  def verdict(self, lag_max: int, age_s: float, lag_min: int = 0) -> str:
    """What the learner does with a batch whose lags span ``lag_min`` .. ``lag_max`` versions
    and whose sampling started ``age_s`` seconds ago: TRAIN, DROP (past the bound k, or from
    a version the learner never made) or EXPIRE (past the lag threshold or the age limit)."""
    if past_bound(lag_max, self.max_staleness) or lag_min < 0:
      return DROP
    if self.lag_threshold is not None and lag_max > self.lag_threshold:
      return EXPIRE
    if self.max_age_s is not None and age_s > self.max_age_s:
      return EXPIRE
    return TRAIN

  def fresh(self, lag_max: int, age_s: float) -> bool:
    """Whether data this old may still be trained on (the replay buffer's eviction rule)."""
    return self.verdict(lag_max, age_s) == TRAIN

  def observe(self, step: int, *, lag_mean: float | None, is_clip_frac: float | None = None,
              entropy: float | None = None) -> list[Event]:
    """One batch received (``entropy`` and ``is_clip_frac`` only when it was trained on;
    ``lag_mean`` None when the batch was started under an earlier k, and so says nothing
    about the current one); returns the changes it caused (also kept in ``events``)."""
    events = []
    if lag_mean is not None:
      events.append(self.staleness.observe(step, lag_mean, is_clip_frac))
    if entropy is not None:
      events.append(self.entropy.observe(step, entropy))
    events = [e for e in events if e is not None]
    self.events += events
    return events

  def metrics(self) -> dict[str, float]:
    """The knobs under control (a knob no controller moves is not reported)."""
    metrics = {"control/k": self.k} if self.staleness.active else {}
    if self.entropy.floor is not None:
      metrics[f"control/{self.entropy.knob}"] = self.entropy.value
    return metrics

  def state(self) -> dict:
    """What a checkpoint keeps, so that a resumed run continues with the same knobs."""
    return {"k": self.staleness.k, "entropy_level": self.entropy.level}

  def restore(self, state: dict | None) -> None:
    if state:
      self.staleness.k = min(int(state["k"]), self.staleness.max_k)
      self.entropy.level = min(int(state["entropy_level"]), KNOB_STEPS)
