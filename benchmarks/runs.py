"""What the benchmarks that run ``python -m rlx.main`` share: config overrides passed through
on their command line, reading the held-out accuracy a run prints, and starting later runs
from the first run's warm-up."""

from __future__ import annotations

import argparse
import pathlib
import re

ACCURACY = re.compile(r"held-out accuracy: before RL ([\d.]+)%, after RL ([\d.]+)%")


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
  """The benchmark's own arguments; ``args.overrides`` holds the ``--config.a.b=value`` ones,
  for every run it starts (anything else is refused)."""
  args, args.overrides = parser.parse_known_args()
  unknown = [a for a in args.overrides if not a.startswith("--config.")]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides look like "
                 "--config.a.b=value)")
  return args


def accuracy(stdout: str) -> tuple[float, float] | None:
  """(before, after) held-out accuracy in [0, 1] from a run's output; None if it printed none."""
  match = ACCURACY.search(stdout)
  return None if match is None else (float(match.group(1)) / 100, float(match.group(2)) / 100)


def warm_start(workdir: pathlib.Path) -> list[str]:
  """Overrides that start a run from the warm-up saved in ``workdir`` (a ``model.path`` run gets
  no warm-up of its own)."""
  return [f"--config.model.path={workdir / 'warmup'}"]
