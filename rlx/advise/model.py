"""The advisor's model: what each deployment's probe measured, and the samples/s, lag and busy
fractions of every deployment predicted from it (``rlx.advise`` says how); for runs of episodes,
the stream's groups in flight."""

from __future__ import annotations

import dataclasses
import math
import statistics

from rlx.config import RunConfig
from rlx.trainer import control


@dataclasses.dataclass
class Probe:
  """What one deployment measured: seconds per batch (medians)."""

  name: str
  generation_devices: int
  learning_devices: int
  generate_s: float
  learn_s: float
  sync_s: float
  generate_concurrent_s: float | None = None
  learn_concurrent_s: float | None = None
  tokens_per_batch: float = 0.0
  in_slot_frac: float | None = None
  """Episodes (``env.name``): the share of an episode's life it held a decode slot."""


@dataclasses.dataclass
class Prediction:
  mode: str
  generation_devices: int
  learning_devices: int
  k: int
  samples_per_s: float
  step_s: float
  policy_lag: float
  generation_busy_frac: float
  learning_busy_frac: float
  basis: str
  """'measured' (this split was probed) or 'interpolated'."""
  memory: dict = dataclasses.field(default_factory=dict)
  """Per target accelerator (``--target``): per-device GiB of this deployment, and whether it
  fits."""

  @property
  def fits(self) -> bool:
    """False when a target's compiler found this deployment too big (unknown counts as fitting)."""
    return all(m.get("fits", True) for m in self.memory.values())

  @property
  def name(self) -> str:
    """The deployment without k (what memory depends on)."""
    return "colocated" if self.mode == "colocated" else (
        f"split {self.generation_devices}+{self.learning_devices}")

  def overrides(self) -> list[str]:
    if self.mode == "colocated":
      return ["--config.mesh.mode=colocated"]
    return ["--config.mesh.mode=split",
            f"--config.mesh.generation_devices={self.generation_devices}",
            f"--config.mesh.max_staleness={self.k}"]

  @property
  def label(self) -> str:
    if self.mode == "colocated":
      return f"colocated ({self.generation_devices} devices)"
    return f"split {self.generation_devices}+{self.learning_devices}, k={self.k}"


def _interpolate(points: dict[int, float], devices: int) -> float:
  """Seconds at ``devices`` from seconds measured at other device counts: a power law through
  the two nearest measured counts (the one measured count's value when there is one)."""
  if devices in points:
    return points[devices]
  counts = sorted(points)
  if len(counts) == 1:
    return points[counts[0]] * counts[0] / devices  # perfect scaling: the only guess
  below = [c for c in counts if c < devices]
  above = [c for c in counts if c > devices]
  a, b = ((below[-1], above[0]) if below and above else
          (counts[0], counts[1]) if not below else (counts[-2], counts[-1]))
  slope = math.log(points[b] / points[a]) / math.log(b / a)
  return points[a] * (devices / a) ** slope


def overlapped(generate_s: float, learn_s: float, generate_slowdown: float,
               learn_slowdown: float) -> tuple[float, bool]:
  """(seconds per batch, whether generation finishes first) when each side works on its own
  batch at once: both slowed while both run, then the slower side alone at full speed."""
  G, L, sg, sl = generate_s, learn_s, generate_slowdown, learn_slowdown
  if G * sg / sl <= L:  # generation's batch is done while learning still has work left
    return G * sg + (L - G * sg / sl), True
  return L * sl + (G - L * sl / sg), False


def predict(probes: list[Probe], devices: int, batch: int, max_k: int = 2) -> list[Prediction]:
  """Every deployment of ``devices`` devices, best first (see the module docstring)."""
  colocated = next((p for p in probes if p.name == "colocated"), None)
  splits = {p.generation_devices: p for p in probes if p.name != "colocated"}
  generate = {p.generation_devices: p.generate_s for p in probes}
  learn = {p.learning_devices: p.learn_s for p in probes}
  predictions = []
  if colocated is not None:
    step = colocated.generate_s + colocated.learn_s
    predictions.append(Prediction("colocated", devices, devices, 0, batch / step, step, 0.0,
                                  colocated.generate_s / step, colocated.learn_s / step,
                                  "measured"))
  for g in range(1, devices):
    probed = splits.get(g)
    G = probed.generate_s if probed else _interpolate(generate, g)
    L = probed.learn_s if probed else _interpolate(learn, devices - g)
    # how much slower each side runs beside the other: measured, or the nearest probe's
    near = probed or (min(splits.values(), key=lambda p: abs(p.generation_devices - g))
                      if splits else None)
    g_slow = near.generate_concurrent_s / near.generate_s if near else 1.0
    l_slow = near.learn_concurrent_s / near.learn_s if near else 1.0
    basis = "measured" if probed else "interpolated"
    step = G + L
    predictions.append(Prediction("split", g, devices - g, 0, batch / step, step, 0.0,
                                  G / step, L / step, basis))
    step, generation_first = overlapped(G, L, g_slow, l_slow)
    generation_busy = G * g_slow / step if generation_first else 1.0
    learning_busy = 1.0 if generation_first else L * l_slow / step
    for k in range(1, max_k + 1):
      lag = float(k) if generation_first else 1.0
      predictions.append(Prediction("split", g, devices - g, k, batch / step, step, lag,
                                    generation_busy, learning_busy, basis))
  # best first; among (nearly) equal speeds, the least lag, then colocated (one program, no
  # second side to keep busy), then measured over interpolated
  return sorted(predictions, key=lambda p: (-round(p.samples_per_s, 2), p.policy_lag,
                                            p.mode != "colocated", p.basis != "measured", p.k))


def groups_needed(config: RunConfig, in_slot_frac: float) -> int:
  """The groups a stream (``mesh.admission=continuous``) keeps admitted so that its episodes
  fill the decode slots: an episode holds a slot ``in_slot_frac`` of its life (released ones
  leave theirs while their environment works), so by Little's law the slots need
  ``max_slots / in_slot_frac`` episodes under way."""
  return math.ceil(config.rollout.max_slots
                   / (max(in_slot_frac, 1e-3) * config.rollout.group_size))


def advised_groups_in_flight(config: RunConfig, in_slot_frac: float, k: int) -> int:
  """The ``mesh.groups_in_flight`` to advise: ``groups_needed``, at least one batch and at
  most what the gate admits at bound ``k`` (``control.admitted_groups``)."""
  return max(config.data.prompts_per_step,
             min(groups_needed(config, in_slot_frac), control.admitted_groups(config, k)))


def stream_advice(config: RunConfig, best: Prediction, probes: list[Probe],
                  max_k: int = 2) -> dict | None:
  """For a run of episodes recommended a split with k >= 1: continuous admission, its
  ``mesh.groups_in_flight`` and, when the slots need more groups than k + 1 batches, the k
  (up to ``max_k``) that admits them. None otherwise: no episodes, agent programs (not
  streamed) or no measure."""
  measured = [p.in_slot_frac for p in probes
              if p.name != "colocated" and p.in_slot_frac is not None]
  if best.mode != "split" or best.k < 1 or not config.env.name or not measured:
    return None
  share, batch = statistics.median(measured), config.data.prompts_per_step
  needed = groups_needed(config, share)
  k = min(max(best.k, math.ceil(needed / batch) - 1), max(max_k, best.k))
  groups = advised_groups_in_flight(config, share, k)
  reason = (f"episodes held a decode slot {share:.0%} of their life (env.release_slots="
            f"{config.env.release_slots}): {needed} groups ({needed * config.rollout.group_size}"
            f" episodes) under way would keep the {config.rollout.max_slots} slots decoding")
  if k > best.k:
    reason += (f"; k={k} lets the gate admit {(k + 1) * batch} groups (k={best.k}: "
               f"{(best.k + 1) * batch}), at a lag of up to {k}")
  if groups < needed:
    reason += f"; the gate admits {groups} (k + 1 = {k + 1} batches; raise --max-k for more)"
  return {"groups_in_flight": groups, "in_slot_frac": share, "k": k,
          "overrides": [f"--config.mesh.max_staleness={k}", "--config.mesh.admission=continuous",
                        f"--config.mesh.groups_in_flight={groups}"],
          "reason": reason}


def reasons(best: Prediction, predictions: list[Prediction], probes: list[Probe]) -> list[str]:
  """One line per reason the advisor gives for ``best``."""
  lines = []
  colocated = next((p for p in predictions if p.mode == "colocated"), None)
  splits = {p.generation_devices: p for p in probes if p.name != "colocated"}
  if splits:
    probe = splits[min(splits, key=lambda g: abs(g - best.generation_devices))]
    ratio = probe.learn_s / probe.generate_s
    slower = "learning" if ratio >= 1 else "generation"
    lines.append(f"at {probe.generation_devices}+{probe.learning_devices} devices {slower} is "
                 f"{max(ratio, 1 / ratio):.2f}x slower than the other side "
                 f"(generate {probe.generate_s:.2f}s, learn {probe.learn_s:.2f}s per batch)")
    if probe.generate_concurrent_s:
      slowed = probe.generate_concurrent_s / probe.generate_s
      lines.append(f"running both at once slows generation {slowed:.2f}x "
                   f"and learning {probe.learn_concurrent_s / probe.learn_s:.2f}x (shared "
                   "host or interconnect)")
  if best.mode == "colocated":
    split = next((p for p in predictions if p.mode == "split" and p.k >= 1), None)
    if split is not None:
      lines.append(f"colocated is on-policy and {best.samples_per_s / split.samples_per_s:.2f}x "
                   f"the best split ({split.label}): overlapping the sides does not pay here")
  else:
    if colocated is not None:
      lines.append(f"{best.label} is {best.samples_per_s / colocated.samples_per_s:.2f}x "
                   f"colocated's samples/s, at a policy lag of about {best.policy_lag:g}")
    if best.k >= 1:
      lines.append(f"k={best.k}: the sides overlap; a larger k only adds lag (the slower side "
                   "sets the pace)")
    if best.basis == "interpolated":
      lines.append("this split was not probed: its times are interpolated from the probed ones")
  return lines
