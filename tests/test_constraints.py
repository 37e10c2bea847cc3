"""constraints.txt pins what the tests run with: each pinned core package is installed at its
pinned version here (so the file is kept true when a dependency moves)."""

import importlib.metadata
import pathlib

ROOT = pathlib.Path(__file__).parent.parent


def test_constraints_match_the_installed_versions():
  pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
              if line and not line.startswith("#"))
  assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore"} <= set(pins)
  # a local build label is the same release ("2.13.0+cpu" is torch 2.13.0's CPU wheel)
  stale = {name: (pin, importlib.metadata.version(name)) for name, pin in pins.items()
           if importlib.metadata.version(name).split("+")[0] != pin}
  assert not stale, f"constraints.txt is behind what is installed (pinned, installed): {stale}"
