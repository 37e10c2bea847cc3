"""The import rules of rlx, checked on the source: who may import whom inside rlx.

Each top-level part of ``rlx`` lists the other parts it may import directly
(``docs/architecture.md`` says what each part is and how they fit). The table has no cycles, so checking direct
imports also rules out the indirect ones. Parts that do not exist yet are
checked as soon as they land.
"""

import ast
import importlib
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent

ALLOWED = {
    "config": set(),
    "cli": {"config"},
    "types": set(),
    # loops traced unrolled for XLA's cost analysis: a context variable, below every program
    "unroll": set(),
    "kernels": {"types", "unroll"},
    "mesh": {"config"},
    # the multi-process helpers: jax and numpy only, below everything that runs on several hosts
    "distributed": set(),
    # what a process is doing and when it last got something done (read by the job status
    # files' liveness check): stdlib and the compile watch, below the engine and the loops
    "progress": {"compilation"},
    # models place each parameter into its sharding on load, so they use the mesh rules.
    "models": {"kernels", "config", "types", "mesh", "unroll"},
    "algorithms": {"types", "config", "kernels"},
    "update": {"models", "algorithms", "kernels", "types", "config", "mesh", "unroll"},
    "rollout": {"models", "mesh", "types", "config", "kernels", "progress"},
    # exact content digests of params: numpy or one jitted program
    "digest": set(),
    # with LoRA, the generator's side merges the shipped adapters into its base (models.lora)
    "sync": {"mesh", "types", "config", "distributed", "models", "digest"},
    # policy versions between jobs as whole or delta files: the sync protocol's third way
    "versions": {"sync", "distributed", "models", "digest"},
    "rewards": {"config", "hostmem"},
    "data": {"config", "types"},
    # environments and tools of multi-turn episodes: plain Python (tools run in reward-like
    # workers, the code tool in the reward's sandbox)
    "envs": {"rewards", "data", "config"},
    # the OpenAI-compatible endpoint on the engine, episodes' trajectories, python -m rlx.serve
    "serve": {"rollout", "models", "envs", "config"},
    "checkpoint": {"config", "types", "distributed", "progress"},
    "metrics": {"config"},
    # JAX's persistent compilation cache and compile-time counters
    "compilation": set(),
    "hostmem": set(),
    "reaper": set(),
    # plots of finished runs from their metrics.jsonl and config.json: plain Python + matplotlib
    "report": set(),
    "trainer": {"config", "cli", "types", "kernels", "mesh", "models", "algorithms", "update",
                "rollout", "sync", "versions", "rewards", "data", "envs", "serve", "checkpoint",
                "metrics", "distributed", "progress"},
    "main": {"trainer", "config", "cli", "mesh", "models", "distributed", "compilation",
             "hostmem", "progress", "reaper"},
    # compiling the learner step and decode for an accelerator that is not here
    # memory traffic read from compiled programs' optimized HLO: text and jax only
    "hlo_traffic": set(),
    # collectives a compiled program's devices may meet in either order: HLO text only
    "hlo_order": set(),
    "aot": {"update", "config", "kernels", "mesh", "models", "rollout", "types", "hlo_traffic"},
    # the deployment advisor: probes runs as main builds them, and models deployments
    "advise": {"trainer", "config", "cli", "main", "aot"},
    # the shipped configs (configs/ in a checkout links here): config values only
    "configs": {"config"},
    # a run's checkpoint as a Hugging Face directory: the model and checkpoint as main builds them
    "export": {"trainer", "config", "cli", "main", "mesh", "models", "update", "checkpoint"},
    # python -m rlx.fetch: a GGUF model converted and checked by the model code
    "fetch": {"models"},
    # python -m rlx.tinker: the Tinker-compatible service on the models, kernels and engine
    "tinker": {"models", "config", "kernels", "rollout", "update"},
}
NEVER_FROM_LIBRARY = {"configs", "launch", "benchmarks", "tests"}
NO_JAX = {"config", "cli", "report", "envs", "configs"}


def _imports(file: pathlib.Path):
  for node in ast.walk(ast.parse(file.read_text())):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.module
      if node.module == "rlx":
        yield from (f"rlx.{alias.name}" for alias in node.names)


def _part(file: pathlib.Path) -> str:
  return file.relative_to(ROOT / "rlx").parts[0].removesuffix(".py")


def test_every_part_of_rlx_has_a_rule():
  parts = {_part(f) for f in (ROOT / "rlx").rglob("*.py")} - {"__init__", "__main__"}
  assert parts <= set(ALLOWED), f"add {parts - set(ALLOWED)} to ALLOWED, below what may import it"


def test_parts_import_only_what_design_allows():
  broken = []
  for file in (ROOT / "rlx").rglob("*.py"):
    part = _part(file)
    if part in ("__init__", "__main__"):
      continue
    for name in _imports(file):
      top, *rest = name.split(".")
      if top in NEVER_FROM_LIBRARY:
        broken.append(f"{file.relative_to(ROOT)} imports {name}")
      if top == "rlx" and rest and rest[0] != part and rest[0] not in ALLOWED[part]:
        broken.append(f"{file.relative_to(ROOT)} imports {name}, but {part} may import only "
                      f"{sorted(ALLOWED[part])}")
      if part in NO_JAX and top in ("jax", "jaxlib", "flax", "numpy"):
        broken.append(f"{file.relative_to(ROOT)} imports {name}; {part} must stay plain Python")
  assert not broken, "\n".join(broken)


def test_config_module_imports_without_jax():
  code = "import sys, rlx.config, rlx.cli; assert 'jax' not in sys.modules, 'config imported jax'"
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_checker_catches_a_forbidden_import(tmp_path, monkeypatch):
  bad = tmp_path / "rlx" / "algorithms" / "bad.py"
  bad.parent.mkdir(parents=True)
  bad.write_text("from rlx.models import transformer\n")
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  try:
    test_parts_import_only_what_design_allows()
  except AssertionError as e:
    assert "rlx/algorithms/bad.py imports rlx.models" in str(e)
  else:
    raise AssertionError("a forbidden import went unnoticed")


def test_every_part_is_described_on_the_architecture_page():
  page = (ROOT / "docs" / "architecture.md").read_text()
  missing = [part for part in ALLOWED if f"rlx/{part}" not in page]
  assert not missing, f"docs/architecture.md does not describe {missing}"


# The trainer's wings (docs/architecture.md): the floor (rlx/trainer/*.py) is below every wing;
# setup builds a run's parts; produce (prompts and weights in, scored draws out) and learn
# (draws in, policy versions out) never import each other; deploy alone wires both together.
WINGS = {"setup": set(), "produce": {"setup"}, "learn": {"setup"},
         "deploy": {"setup", "produce", "learn"}}


def _wing(file: pathlib.Path) -> str | None:
  """The wing ``file`` belongs to, "floor" for the trainer's own modules, None outside."""
  parts = file.relative_to(ROOT / "rlx").parts
  if parts[0] != "trainer":
    return None
  return parts[1] if len(parts) > 2 else "floor"


def test_the_trainer_wings_import_only_what_design_allows():
  broken = []
  for file in (ROOT / "rlx" / "trainer").rglob("*.py"):
    wing = _wing(file)
    if file.name == "__init__.py" and wing == "floor":
      continue  # rlx.trainer re-exports every wing's public names
    for name in _imports(file):
      parts = name.split(".")
      if parts[:2] != ["rlx", "trainer"] or len(parts) < 3 or parts[2] not in WINGS:
        continue
      if parts[2] == wing:
        continue
      if wing == "floor" or parts[2] not in WINGS[wing]:
        allowed = "no wing" if wing == "floor" else sorted(WINGS[wing]) or "no other wing"
        broken.append(f"{file.relative_to(ROOT)} ({wing}) imports {name}; it may import {allowed}")
  assert not broken, "\n".join(broken)


def test_the_wing_checker_catches_a_learner_importing_a_producer(tmp_path, monkeypatch):
  bad = tmp_path / "rlx" / "trainer" / "learn" / "bad.py"
  bad.parent.mkdir(parents=True)
  bad.write_text("from rlx.trainer.produce.evaluate import evaluate\n")
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  with pytest.raises(AssertionError, match="learn/bad.py .learn. imports rlx.trainer.produce"):
    test_the_trainer_wings_import_only_what_design_allows()


def test_what_the_benchmarks_and_configs_import_from_rlx_exists():
  """A move inside rlx updates every importer: the benchmarks and configs too, which no other
  test imports (a benchmark that no longer starts is found at the next measurement)."""
  missing = []
  for file in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "configs").glob("*.py")]:
    for node in ast.walk(ast.parse(file.read_text())):
      if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rlx"):
        module = importlib.import_module(node.module)
        missing += [f"{file.name}: {node.module}.{alias.name}" for alias in node.names
                    if not hasattr(module, alias.name)
                    and importlib.util.find_spec(f"{node.module}.{alias.name}") is None]
  assert not missing, missing
