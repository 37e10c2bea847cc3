"""The config schema, every shipped config file, overrides and the CLI's refusals."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

from rlx import cli
from rlx.config import ArchConfig, ConfigError, RunConfig

ROOT = pathlib.Path(__file__).parent.parent
CONFIG_FILES = sorted((ROOT / "configs").glob("*.py"))
CONFIG_FILES = [p for p in CONFIG_FILES if p.name != "__init__.py"]


def _sections(cls):
  yield cls
  for f in dataclasses.fields(cls):
    hint = cli._type_hints(cls)[f.name]
    if dataclasses.is_dataclass(hint):
      yield from _sections(hint)


def test_every_field_has_a_docstring():
  for cls in _sections(RunConfig):
    docs = cli.field_docs(cls)
    undocumented = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not undocumented, f"{cls.__name__} fields without a docstring: {undocumented}"


def test_configs_are_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    RunConfig().name = "x"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_config_file_loads(path):
  config = cli.load_config_file(str(path))
  assert isinstance(config, RunConfig)
  source = path.read_text()
  assert "python -m rlx.main --config configs/" + path.name in source, "docstring lacks its run command"
  json.loads(cli.to_json(config))


def test_shipped_configs_choose_their_algorithm_and_mode():
  dapo = cli.load_config_file(str(ROOT / "configs/dapo_split.py"))
  assert (dapo.algorithm.name, dapo.mesh.mode, dapo.algorithm.clip_eps_high) == ("dapo", "split", 0.28)
  assert cli.load_config_file(str(ROOT / "configs/grpo_colocated.py")).mesh.mode == "colocated"
  assert cli.load_config_file(str(ROOT / "configs/ppo_colocated.py")).algorithm.name == "ppo"


def test_overrides_are_typed():
  config = cli.apply_overrides(RunConfig(), [
      "--config.rollout.top_k=5", "--config.optimizer.learning_rate=3e-6",
      "--config.logging.tensorboard=false", "--config.model.path=/models/x",
      "--config.algorithm.dual_clip=3", "--config.algorithm.name=dapo",
      "--config.model.arch.eos_token_ids=[2, 7]",
      '--config.mesh.logical_axis_rules=[["embed", "fsdp"], ["mlp", null]]'])
  assert config.rollout.top_k == 5 and isinstance(config.rollout.top_k, int)
  assert config.optimizer.learning_rate == 3e-6
  assert config.logging.tensorboard is False
  assert config.model.path == "/models/x"
  assert config.algorithm.dual_clip == 3.0 and isinstance(config.algorithm.dual_clip, float)
  assert config.algorithm.name == "dapo"
  assert config.model.arch.eos_token_ids == (2, 7)
  assert config.mesh.logical_axis_rules == (("embed", "fsdp"), ("mlp", None))
  assert cli.apply_overrides(config, ["--config.model.path=none"]).model.path is None


@pytest.mark.parametrize("override, expected", [
    ("--config.rollout.topk=5", "unknown key config.rollout.topk; closest valid keys: config.rollout.top_k"),
    ("--config.num_layers=2", "closest valid keys: config.model.arch.num_layers"),
    ("--config.rollot.top_k=2", "closest valid keys: config.rollout"),
    ("--config.rollout.top_k=many", "config.rollout.top_k='many': expected int"),
    ("--config.rollout.top_k=1.5", "config.rollout.top_k='1.5': expected int"),
    ("--config.logging.jsonl=maybe", "expected a bool"),
    ("--config.algorithm.name=dappo", "must be one of 'ppo'"),
    ("--config.algorithm.name=dappo", "did you mean 'dapo'?"),
    ("--config.model.arch=3", "config.model.arch is a section"),
    ("--config.rollout.top_k.x=3", "is a value, not a section"),
    ("--config.rollout.temperature=-1", "config.rollout.temperature: must be >= 0"),
    ("--config.model.arch.num_kv_heads=3", "must be a multiple of num_kv_heads=3"),
])
def test_bad_overrides_are_refused_naming_the_key(override, expected):
  with pytest.raises(ConfigError) as error:
    cli.apply_overrides(RunConfig(), [override])
  assert expected in str(error.value)


def test_arch_validation():
  with pytest.raises(ConfigError, match="head_dim"):
    ArchConfig(head_dim=7)


def test_parse_args_needs_config_and_workdir(tmp_path):
  with pytest.raises(ConfigError, match="--workdir is required"):
    cli.parse_args(["--config", "configs/base.py"])
  with pytest.raises(ConfigError, match="does not exist"):
    cli.parse_args(["--config", str(tmp_path / "nope.py"), "--workdir", str(tmp_path)])
  with pytest.raises(ConfigError, match="did you mean --workdir"):
    cli.parse_args(["--config", "configs/base.py", "--workdr", str(tmp_path)])
  invocation = cli.parse_args(["--config=configs/base.py", "--workdir", str(tmp_path),
                               "--config.trainer.steps", "7"])
  assert invocation.config.trainer.steps == 7 and invocation.workdir == tmp_path


def _rlx_main(*args, cwd=ROOT):
  return subprocess.run([sys.executable, "-m", "rlx.main", *args], cwd=cwd, capture_output=True,
                        text=True, timeout=300)


def test_main_refuses_a_misspelled_override_and_runs_nothing(tmp_path):
  result = _rlx_main("--config", "configs/dapo_split.py", "--workdir", str(tmp_path / "run"),
                     "--config.rollout.max_new_tokns=9")
  assert result.returncode == 2
  assert "config.rollout.max_new_tokns" in result.stderr
  assert "config.rollout.max_new_tokens" in result.stderr
  assert not (tmp_path / "run").exists()


def test_main_help_prints_field_docs():
  result = _rlx_main("--help")
  assert result.returncode == 0
  assert "--config.rollout.top_p=1.0" in result.stdout
  assert "Nucleus sampling mass" in result.stdout


def test_main_trains_the_default_split_config_and_says_where_results_are(tmp_path):
  from tests.trainer.tiny import OVERRIDES

  workdir = tmp_path / "run"
  result = _rlx_main("--config", "configs/dapo_split.py", "--workdir", str(workdir), *OVERRIDES,
                     "--config.trainer.steps=2", "--config.algorithm.dynamic_sampling=false")
  assert result.returncode == 0, result.stderr
  written = json.loads((workdir / "config.json").read_text())
  assert written["mesh"]["mode"] == "split" and written["model"]["arch"]["num_layers"] == 1
  assert "2 steps in" in result.stdout
  assert "held-out accuracy: before RL" in result.stdout
  assert f"metrics:     {workdir / 'metrics.jsonl'}" in result.stdout
  assert f"checkpoints: {workdir / 'checkpoints'}" in result.stdout


def test_main_trains_a_hugging_face_model_with_its_tokenizer(tmp_path):
  from tests.trainer.tiny import OVERRIDES

  result = _rlx_main("--config", "configs/grpo_colocated.py", "--workdir", str(tmp_path),
                     "--config.model.path=tests/fixtures/hf/qwen2", "--config.mesh.tensor=2",
                     *OVERRIDES, "--config.trainer.steps=1", "--config.trainer.warmup_sft_steps=0",
                     "--config.rollout.max_prompt_len=128")
  assert result.returncode == 0, result.stderr
  assert "model=tests/fixtures/hf/qwen2" in result.stdout and "1 steps in" in result.stdout


def test_main_names_a_malformed_data_row(tmp_path):
  data = tmp_path / "prompts.jsonl"
  data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "no answer"}\n')
  result = _rlx_main("--config", "configs/grpo_colocated.py", "--workdir", str(tmp_path / "run"),
                     f"--config.data.source={data}", "--config.trainer.warmup_sft_steps=0")
  assert result.returncode == 2
  assert f"{data}:2" in result.stderr and "Traceback" not in result.stderr


def test_main_reports_a_broken_checkpoint_clearly(tmp_path):
  result = _rlx_main("--config", "configs/grpo_colocated.py", "--workdir", str(tmp_path / "run"),
                     f"--config.model.path={tmp_path}")
  assert result.returncode == 2
  assert "no config.json" in result.stderr and "Traceback" not in result.stderr
