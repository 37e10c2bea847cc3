"""The config schema, every shipped config file, overrides and the CLI's refusals."""

import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import typing

import pytest

from rlx import cli
from rlx.config import ArchConfig, ConfigError, RunConfig, check

ROOT = pathlib.Path(__file__).parent.parent
CONFIG_FILES = sorted(p for p in (ROOT / "configs").glob("*.py") if not p.name.startswith("_"))
CONFIG_FILES = [p for p in CONFIG_FILES if p.name != "__init__.py"]
CONFIG_FILES += sorted((ROOT / "examples").glob("*/config.py"))  # the examples' configs too


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


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_file_loads(path):
  config = cli.load_config_file(str(path))
  assert isinstance(config, RunConfig)
  source = path.read_text()
  command = f"python -m rlx.main --config {path.relative_to(ROOT)}"
  assert command in source, "docstring lacks its run command"
  json.loads(cli.to_json(config))


def test_shipped_configs_choose_their_algorithm_and_mode():
  dapo = cli.load_config_file(str(ROOT / "configs/dapo_split.py"))
  assert (dapo.algorithm.name, dapo.mesh.mode, dapo.algorithm.eps_high) == ("dapo", "split", 0.28)
  assert dapo.algorithm.dynamic and dapo.algorithm.aggregation == "token-mean"


def test_shipped_configs_leave_to_the_preset_what_it_fills():
  for name in ("base", "dapo_split", "grpo_colocated", "ppo_colocated", "smollm2_math",
               "smollm2_calc"):
    config = cli.load_config_file(str(ROOT / "configs" / f"{name}.py"))
    assert config.algorithm.pinned_over_preset() == [], name
  # the code recipes run GRPO with DAPO's clip-higher on purpose: the start line says so
  code = cli.load_config_file(str(ROOT / "configs/code_grpo.py"))
  assert "clip_eps_high=0.28 (grpo's: 0.2)" in code.algorithm.pinned_over_preset()
  grpo = cli.load_config_file(str(ROOT / "configs/grpo_colocated.py"))
  gspo = cli.apply_overrides(grpo, ["--config.algorithm.name=gspo"])
  assert (gspo.algorithm.eps_low, gspo.algorithm.eps_high) == (3e-4, 4e-4)
  pinned = cli.apply_overrides(grpo, ["--config.algorithm.name=gspo",
                                      "--config.algorithm.clip_eps_high=0.2"])
  assert pinned.algorithm.pinned_over_preset() == ["clip_eps_high=0.2 (gspo's: 0.0004)"]
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
    # a list's example has the field's own shape; other trainers' names point at rlx's
    ("--config.rollout.stop_strings=</answer>", """expected a JSON list, e.g. '["text"]'"""),
    ("--config.reward.extra=x", """e.g. '[["text", 0.5]]'"""),
    ("--config.lr=1e-5", "unknown key config.lr; rlx calls it config.optimizer.learning_rate"),
    ("--config.trainer.max_steps=9", "rlx calls it config.trainer.steps"),
    ("--config.output_dir=x", "rlx calls it --workdir"),
    ("--config.rollout.partial=false", "rlx calls it config.mesh.inflight_updates"),
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


def test_help_with_a_config_shows_its_values(capsys):
  assert cli.parse_args(["--help", "--config", str(ROOT / "configs/dapo_split.py"),
                         "--config.rollout.top_p=0.9"]) is None
  out = capsys.readouterr().out
  assert "Values shown: " in out and "dapo_split.py" in out
  assert "--config.algorithm.name='dapo'" in out and "--config.rollout.top_p=0.9" in out
  assert cli.parse_args(["--help"]) is None
  assert "--config.algorithm.name='grpo'" in capsys.readouterr().out  # the schema's default


def test_help_into_a_closed_pipe_ends_without_a_traceback():
  process = subprocess.Popen([sys.executable, "-m", "rlx.main", "--help"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  process.stdout.read(200)
  process.stdout.close()  # like `| head`
  _, err = process.communicate(timeout=120)
  assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]


def test_main_trains_the_default_split_config_and_says_where_results_are(tmp_path):
  from tests.trainer.tiny import OVERRIDES

  workdir = tmp_path / "run"
  result = _rlx_main("--config", "configs/dapo_split.py", "--workdir", str(workdir), *OVERRIDES,
                     "--config.trainer.steps=2", "--config.algorithm.dynamic_sampling=false",
                     "--config.checkpoint.every_steps=1", "--config.logging.samples_every=1",
                     # an entropy bonus: gradients before the tiny model earns any reward
                     "--config.algorithm.entropy_coef=0.01")
  assert result.returncode == 0, result.stderr
  written = json.loads((workdir / "config.json").read_text())
  assert written["mesh"]["mode"] == "split" and written["model"]["arch"]["num_layers"] == 1
  assert "2 steps in" in result.stdout
  assert re.search(r"rlx: time: start-up \d+s, warm-up \d+s, RL loop \d+s, held-out evals \d+s",
                   result.stdout), result.stdout
  assert "algorithm=dapo (advantage grpo, loss ppo_clip)" in result.stdout
  assert "held-out accuracy: before RL" in result.stdout
  assert f"metrics:     {workdir / 'metrics.jsonl'}" in result.stdout
  assert f"checkpoints: {workdir / 'checkpoints'}" in result.stdout
  # the final policy, exported whatever checkpoint.export_hf_every says, and its eval figures
  final = workdir / "hf" / "final"
  assert f"final policy (step 2) in Hugging Face format: {final}" in result.stdout
  assert {"config.json", "model.safetensors"} <= {p.name for p in final.iterdir()}
  assert not final.with_name("final.partial").exists()
  assert json.loads((workdir / "eval_initial.json").read_text())["step"] == 0  # the baseline
  evaluated = json.loads((workdir / "eval_final.json").read_text())
  assert evaluated["step"] == 2 and 0 <= evaluated["eval/accuracy"] <= 1
  last = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
  assert last["step"] == 2 and last["eval/accuracy"] == evaluated["eval/accuracy"]  # logged too
  # what the model generated, readable: every step, the first 2 groups (2 samples each)
  samples = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
  assert [(s["step"], s["group"]) for s in samples] == [(1, 0), (1, 0), (1, 1), (1, 1),
                                                        (2, 0), (2, 0), (2, 1), (2, 1)]
  assert all(isinstance(s["prompt"], str) and s["prompt"] and isinstance(s["response"], str)
             and s["finish_reason"] in ("stop", "length") for s in samples)
  from tests.test_export import check_export

  check_export(workdir, tmp_path)


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


# (override, the field the error must name); every one exits with 2 before anything runs.
INVALID = [
    ("trainer.ppo_epochs=0", "trainer.ppo_epochs"),
    ("logging.every_steps=0", "logging.every_steps"),
    ("trainer.warmup_sft_steps=-1", "trainer.warmup_sft_steps"),
    ("model.logprob_chunk=0", "model.logprob_chunk"),
    ("trainer.steps=-5", "trainer.steps"),
    ("trainer.steps=0", "trainer.steps"),
    ("reward.timeout_s=-1", "reward.timeout_s"),
    ("reward.timeout_s=0", "reward.timeout_s"),
    ("reward.num_workers=-1", "reward.num_workers"),
    ("optimizer.b1=5", "optimizer.b1"),
    ("optimizer.b2=1", "optimizer.b2"),
    ("optimizer.eps=0", "optimizer.eps"),
    ("optimizer.max_grad_norm=-1", "optimizer.max_grad_norm"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay"),
    ("optimizer.warmup_steps=-1", "optimizer.warmup_steps"),
    ("optimizer.micro_batches=3", "optimizer.micro_batches"),  # 64 samples a step
    ("trainer.eval_prompts=-1", "trainer.eval_prompts"),
    ("trainer.eval_every=-1", "trainer.eval_every"),
    ("trainer.warmup_sft_batch=0", "trainer.warmup_sft_batch"),
    ("trainer.warmup_sft_until=1.5", "trainer.warmup_sft_until"),
    ("trainer.max_skipped_steps=0", "trainer.max_skipped_steps"),
    ("checkpoint.max_to_keep=0", "checkpoint.max_to_keep"),
    ("checkpoint.every_steps=-1", "checkpoint.every_steps"),
    ("checkpoint.export_hf_every=-2", "checkpoint.export_hf_every"),
    ("rollout.group_size=1", "rollout.group_size"),  # GRPO's baseline needs a group
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.temperature=-1", "rollout.temperature"),
    ("data.num_epochs=0", "data.num_epochs"),
    ("data.eval_fraction=1", "data.eval_fraction"),
    ("data.prompts_per_step=0", "data.prompts_per_step"),
    ("algorithm.kl_coef=-1", "algorithm.kl_coef"),
    ("algorithm.tis_cap=0", "algorithm.tis_cap"),
    ("algorithm.kl_target=0", "algorithm.kl_target"),
    ("algorithm.value_clip=0", "algorithm.value_clip"),
    ("mesh.max_staleness=-1", "mesh.max_staleness"),
    ("rollout.cache_layout=per-layer", "rollout.cache_layout"),
    # values that can never act or are sure to misbehave
    ("algorithm.entropy_target=50", "algorithm.entropy_target"),
    ("checkpoint.write_buffer_mb=1000000000000", "checkpoint.write_buffer_mb"),
    ("trainer.hang_timeout_s=0.01", "trainer.hang_timeout_s"),
    ("env.release_slots=true", "env.release_slots"),
]

VALID = [
    "trainer.ppo_epochs=2", "logging.every_steps=5", "trainer.warmup_sft_steps=0",
    "model.logprob_chunk=64", "trainer.steps=1", "reward.timeout_s=0.5", "reward.num_workers=0",
    "optimizer.b1=0", "optimizer.b2=0.95", "optimizer.eps=1e-6", "optimizer.max_grad_norm=0",
    "optimizer.weight_decay=0.1", "optimizer.warmup_steps=10", "optimizer.micro_batches=4",
    "trainer.eval_prompts=0", "trainer.eval_every=0", "trainer.warmup_sft_batch=1",
    "trainer.max_skipped_steps=1", "checkpoint.max_to_keep=1", "checkpoint.every_steps=0",
    "checkpoint.export_hf_every=10", "rollout.group_size=2", "rollout.top_p=1",
    "rollout.temperature=0", "data.num_epochs=1", "data.eval_fraction=0.5",
    "data.prompts_per_step=1", "algorithm.kl_coef=0.01", "algorithm.tis_cap=1",
    "algorithm.kl_target=0.1", "algorithm.value_clip=None", "mesh.max_staleness=0",
    "rollout.cache_layout=stacked", "algorithm.entropy_target=0.5", "trainer.hang_timeout_s=0",
    "trainer.hang_timeout_s=60", "checkpoint.write_buffer_mb=64",
]


@pytest.mark.parametrize("override, field", INVALID, ids=[o for o, _ in INVALID])
def test_a_bad_value_is_refused_in_one_line_naming_the_field(override, field, capsys):
  from rlx import main

  status = main.main(["--config", str(ROOT / "configs/base.py"), "--workdir", "/nonexistent",
                      f"--config.{override}"])
  error = capsys.readouterr().err
  assert status == 2, error
  first = error.splitlines()[0]
  assert first.startswith(f"rlx: error: config.{field}") and "must" in first, error
  assert "Traceback" not in error


@pytest.mark.parametrize("override", VALID)
def test_a_good_value_of_each_checked_field_is_accepted(override):
  invocation = cli.parse_args(["--config", str(ROOT / "configs/base.py"), "--workdir", "/tmp/x",
                               f"--config.{override}"])
  assert invocation is not None


def test_group_size_one_is_fine_without_a_group_baseline():
  cli.parse_args(["--config", str(ROOT / "configs/ppo_colocated.py"), "--workdir", "/tmp/x",
                  "--config.rollout.group_size=1"])


def test_a_refused_value_exits_2_without_a_traceback_from_the_command_line():
  result = subprocess.run([sys.executable, "-m", "rlx.main", "--config", "configs/dapo_split.py",
                           "--workdir", "/nonexistent", "--config.trainer.ppo_epochs=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert "config.trainer.ppo_epochs: must be > 0" in result.stderr
  assert "Traceback" not in result.stderr


def test_the_preset_fills_the_typed_choices_and_overrides_win():
  parse = lambda *overrides: cli.parse_args(["--config", str(ROOT / "configs/base.py"),
                                             "--workdir", "/tmp/x", *overrides]).config.algorithm
  algo = parse("--config.algorithm.name=gspo")
  assert (algo.advantage_estimator, algo.loss, algo.uses_critic) == ("grpo", "gspo", False)
  algo = parse("--config.algorithm.name=ppo", "--config.rollout.group_size=1")
  assert (algo.advantage_estimator, algo.loss, algo.uses_critic) == ("gae", "ppo_clip", True)
  algo = parse("--config.algorithm.name=dapo", "--config.algorithm.policy_loss=cispo",
               "--config.algorithm.advantage=dr_grpo")
  assert (algo.advantage_estimator, algo.loss) == ("dr_grpo", "cispo")


@pytest.mark.parametrize("overrides, message", [
    (("--config.algorithm.name=ppo", "--config.algorithm.advantage=rloo",
      "--config.rollout.group_size=1"), "config.rollout.group_size: must be >= 2 for the 'rloo'"),
    (("--config.algorithm.name=grpo", "--config.algorithm.kl_in_reward=true"),
     "config.algorithm.kl_in_reward: needs per-token returns"),
    (("--config.algorithm.policy_loss=gpo",), "must be one of"),
])
def test_incoherent_algorithm_choices_are_refused(overrides, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    cli.parse_args(["--config", str(ROOT / "configs/base.py"), "--workdir", "/tmp/x", *overrides])


def test_each_choice_has_exactly_one_table_entry():
  from rlx import algorithms
  from rlx.config import PRESETS, AlgorithmConfig

  hints = cli._type_hints(AlgorithmConfig)
  advantages = set(typing.get_args(hints["advantage"])) - {"auto"}
  losses = set(typing.get_args(hints["policy_loss"])) - {"auto"}
  assert advantages == set(algorithms.ADVANTAGES) | {"gae"}  # gae needs the learner's critic
  assert losses == set(algorithms.POLICY_LOSSES)
  assert set(PRESETS) == set(typing.get_args(hints["name"]))
  assert {p.advantage for p in PRESETS.values()} <= advantages
  assert {p.loss for p in PRESETS.values()} <= losses
  assert set(typing.get_args(hints["off_policy"])) == set(algorithms.OFF_POLICY)


@pytest.mark.parametrize("override", ["--config.optimizer.learning_rate=inf",
                                      "--config.algorithm.kl_coef=inf",
                                      "--config.trainer.warmup_sft_learning_rate=inf",
                                      "--config.reward.format_weight=inf"])
def test_inf_and_nan_are_refused_naming_the_field(override):
  from tests.trainer import tiny

  field = override.split("=")[0].removeprefix("--")
  with pytest.raises(ConfigError, match=f"{field}: .* is not a finite number"):
    check(tiny.config("grpo_colocated", override))


def test_a_refused_resume_names_the_config_fields_that_changed(tmp_path):
  import types

  from rlx.trainer.learn.lifecycle import _what_changed

  before = cli.load_config_file("configs/grpo_colocated.py")
  after = cli.apply_overrides(before, ["--config.model.arch.hidden_size=48",
                                       "--config.optimizer.learning_rate=0.5"])
  assert cli.config_changes(json.loads(cli.to_json(before)), after) == [
      "model.arch.hidden_size: 128 -> 48", "optimizer.learning_rate: 0.0003 -> 0.5"]
  run = types.SimpleNamespace(workdir=tmp_path, config=after)
  assert _what_changed(run) == ""  # no earlier start kept
  (tmp_path / "config.20261202-100000.json").write_text(cli.to_json(before))
  said = _what_changed(run)
  assert "config.20261202-100000.json" in said and "model.arch.hidden_size" in said
  assert "optimizer.learning_rate" in said


def test_a_config_outside_the_checkout_imports_the_shipped_ones(tmp_path):
  mine = tmp_path / "elsewhere" / "mine.py"
  mine.parent.mkdir()
  mine.write_text("import dataclasses\nfrom rlx.configs import dapo_split\n\n"
                  "def get_config():\n"
                  "  return dataclasses.replace(dapo_split.get_config(), name='mine')\n")
  assert cli.load_config_file(str(mine)).name == "mine"
  legacy = tmp_path / "elsewhere" / "legacy.py"  # written when the configs were not a package
  legacy.write_text("from configs import base\n\ndef get_config():\n  return base.get_config()\n")
  code = ("import sys; from rlx import cli; "
          f"print(cli.load_config_file({str(legacy)!r}).name)")
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, check=True).stdout
  assert out.strip() == "base"


def test_an_error_the_run_did_not_mean_keeps_its_traceback_in_the_workdir(tmp_path, capsys,
                                                                          monkeypatch):
  from rlx import main

  def deep_inside():
    return max([])  # a bug, not a refusal: the one-line message alone would hide where

  monkeypatch.setattr(main, "run", lambda config, workdir: deep_inside())
  status = main.main(["--config", str(ROOT / "configs/base.py"), "--workdir", str(tmp_path)])
  error = capsys.readouterr().err.splitlines()
  assert status == 2
  assert error[0].startswith("rlx: error: max()")
  assert error[1] == f"rlx: the traceback is in {tmp_path / 'error.log'}"
  kept = (tmp_path / "error.log").read_text()
  assert "Traceback" in kept and "deep_inside" in kept
