"""Every shipped config runs a few steps at a tiny size, through the loop its mesh mode asks for."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from rlx.trainer import train
from tests.trainer import tiny

EXPECTED = ("reward/mean", "reward/accuracy", "reward/kept_mean", "response/length_mean",
            "policy/kl_behaviour", "policy/entropy", "advantage/std", "optim/grad_norm",
            "policy/clip_frac_high", "rollout/policy_lag_max", "time/step_s", "time/sync_s",
            "throughput/tokens_per_s")


@pytest.mark.parametrize("name", ["base", "grpo_colocated", "ppo_colocated", "dapo_split"])
def test_each_config_runs_a_few_steps(name, tmp_path):
  # dynamic sampling needs groups of varied rewards, which a random tiny model rarely gives
  config = tiny.config(name, "--config.trainer.steps=2", "--config.algorithm.dynamic_sampling=false")
  summary = train(config, tmp_path, say=lambda message: None)
  assert summary.steps == 2 and not summary.stopped
  rows = tiny.metrics(tmp_path)
  assert [row["step"] for row in rows] == [1, 2]
  for key in EXPECTED:
    assert key in rows[-1], key
  assert all(np.isfinite(row["loss"]) for row in rows)
  if name == "ppo_colocated":
    assert "critic/value_mse" in rows[-1]
  assert 0 <= rows[-1]["advantage/zero_groups_frac"] <= 1
  for row in rows:  # every token is at least as new as its row's oldest, and colocated: current
    assert 0 <= row["rollout/token_lag_mean"] <= row["rollout/policy_lag_max"], row
  if name == "dapo_split":
    for side in ("generation", "learning"):
      assert 0 <= rows[-1][f"time/{side}_busy_frac"] <= 1
      assert 0 <= rows[-1][f"time/{side}_busy_frac_window"] <= 1
  assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "warmup" / "config.json").is_file()


def test_mini_batches_make_the_clipped_objective_act(tmp_path):
  config = tiny.config("dapo_split", "--config.trainer.steps=3", "--config.trainer.mini_batches=2",
                       "--config.reward.name=tests.trainer.toy_rewards:odd_length",  # varied

                       "--config.rollout.group_size=4", "--config.trainer.ppo_epochs=2",
                       "--config.algorithm.dynamic_sampling=false",
                       "--config.optimizer.learning_rate=1e-2")
  train(config, tmp_path, say=lambda message: None)
  rows = tiny.metrics(tmp_path)
  assert all(row["train/updates"] == 4 for row in rows)
  assert any(row["policy/ratio_max"] > 1.0 + 1e-3 for row in rows), rows
  assert any(row["policy/clip_frac_high"] > 0 for row in rows), rows
  assert "policy/kl" not in rows[0]  # no reference policy: its KL is not made up


@pytest.mark.parametrize("mode", ["split", "colocated", "stream"])
def test_agent_config_runs_episodes_in_both_deployments(mode, tmp_path):
  # stream: split with continuous admission (a parked episode keeps its slot, new groups take
  # the free ones)
  deployment = (["--config.mesh.mode=split", "--config.mesh.admission=continuous"]
                if mode == "stream" else [f"--config.mesh.mode={mode}"])
  config = tiny.config("agent_calc", "--config.trainer.steps=2",
                       "--config.algorithm.dynamic_sampling=false", *deployment,
                       "--config.env.max_tokens=8", "--config.env.turn_max_new_tokens=4",
                       "--config.env.tool_workers=1")
  summary = train(config, tmp_path, say=lambda message: None)
  assert summary.steps == 2 and not summary.stopped
  rows = tiny.metrics(tmp_path)
  for key in ("agent/turns_mean", "agent/tool_calls_mean", "agent/truncated_frac",
              "rollout/slot_occupancy", "time/env_s", "agent/malformed_calls"):
    assert key in rows[-1] and np.isfinite(rows[-1][key]), key
  assert rows[-1]["agent/turns_mean"] >= 1 and 0 < rows[-1]["rollout/slot_occupancy"] <= 1
  assert (tmp_path / "episodes.jsonl").is_file()
  final = json.loads((tmp_path / "eval_final.json").read_text())  # the greedy episodes' too
  assert final["eval/turns_mean"] >= 1 and final["eval/tool_calls_mean"] >= 0, final


@pytest.mark.parametrize("admission", ["batch", "continuous"])
def test_an_environment_whose_reset_fails_on_some_rows_skips_them_counted(admission, tmp_path):
  config = tiny.config("agent_calc", "--config.trainer.steps=2",
                       "--config.algorithm.dynamic_sampling=false", "--config.mesh.mode=split",
                       f"--config.mesh.admission={admission}",
                       "--config.env.name=tests/trainer/flaky_env.py:make_env",
                       "--config.env.max_tokens=8", "--config.env.turn_max_new_tokens=4",
                       "--config.env.tool_workers=1", "--config.data.prompts_per_step=4")
  summary = train(config, tmp_path, say=lambda message: None)
  assert summary.steps == 2 and not summary.stopped
  rows = tiny.metrics(tmp_path)
  assert sum(row["agent/env_errors"] for row in rows) > 0, rows


def test_an_environment_that_never_returns_cannot_hang_the_run(tmp_path):
  # a step() that never returned kept the finished run from exiting (the pool's threads were
  # joined at exit), and a reset() that never returned hung the start
  command = [sys.executable, "-m", "rlx.main", "--config", "configs/agent_calc.py",
             "--workdir", str(tmp_path), *tiny.OVERRIDES, "--config.trainer.steps=2",
             "--config.algorithm.dynamic_sampling=false", "--config.mesh.mode=colocated",
             "--config.env.name=tests/trainer/flaky_env.py:make_stuck_env",
             "--config.env.max_tokens=8", "--config.env.turn_max_new_tokens=4",
             "--config.env.tool_workers=1", "--config.env.step_timeout_s=1",
             "--config.data.prompts_per_step=4", "--config.trainer.warmup_sft_steps=0"]
  result = subprocess.run(command, cwd=tiny.ROOT, capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  assert "2 steps in" in result.stdout
  rows = tiny.metrics(tmp_path)
  assert sum(row["agent/env_errors"] + row["agent/env_timeouts"] for row in rows) > 0


def test_episode_prompts_past_the_limit_are_refused_before_the_warm_up(tmp_path):
  # the environment's first messages (tool schemas, a preamble) made the first prompt too
  # long: this was found after the warm-up
  config = tiny.config("agent_calc", "--config.env.name=tests/trainer/flaky_env.py:make_verbose_env",
                       "--config.env.max_tokens=8", "--config.trainer.warmup_sft_steps=50")
  said = []
  with pytest.raises(ValueError, match=r"the first messages with the tools' schemas are \d+ "
                     r"tokens, more than rollout.max_prompt_len=\d+; raise it"):
    train(config, tmp_path, say=said.append)
  assert not any("warm-up" in line for line in said) and not (tmp_path / "warmup").exists()


def test_agent_program_trains_through_the_endpoint(tmp_path):
  # split: the generator thread and the learner's evals share the endpoint (colocated runs the
  # same run_agent_programs, tested on its own in test_agent_programs.py)
  config = tiny.config("agent_calc_openai", "--config.trainer.steps=2",
                       "--config.algorithm.dynamic_sampling=false", "--config.mesh.mode=split",
                       "--config.env.turn_max_new_tokens=4", "--config.trainer.eval_every=2")
  summary = train(config, tmp_path, say=lambda message: None)
  assert summary.steps == 2 and not summary.stopped
  rows = tiny.metrics(tmp_path)
  for key in ("agent/turns_mean", "agent/requests_mean", "agent/failed_frac",
              "rollout/slot_occupancy", "agent/dropped_token_frac", "eval/accuracy"):
    assert key in rows[-1] and np.isfinite(rows[-1][key]), key
  assert rows[-1]["agent/requests_mean"] >= 1 and rows[-1]["agent/failed_frac"] == 0
  assert 0 < rows[-1]["rollout/slot_occupancy"] <= 1


def test_the_warm_up_of_an_agent_run_sees_the_episodes_prompts():
  # it was encoded without the environment's first messages (the tools' schemas): the model
  # was warmed up on prompts the episodes never show
  from rlx.data import PromptStream, TaskSource
  from rlx.models import builtin_tokenizer
  from rlx.trainer.setup.prompts import episode_prompted, prompt_encoder

  config = tiny.config("agent_calc", "--config.env.name=tests/trainer/flaky_env.py:make_verbose_env",
                       "--config.env.max_tokens=8", "--config.rollout.max_prompt_len=512")
  tokenizer = builtin_tokenizer()
  plain = PromptStream(TaskSource("calc"), batch_size=2, seed=0,
                       encode=prompt_encoder(config, tokenizer))
  batch = next(iter(episode_prompted(config, tokenizer, iter([next(plain)]))))
  for row in batch:
    text = tokenizer.decode(row["prompt_tokens"])
    assert text.startswith("Think step by step.") and row["prompt"] in text


def test_the_watchdog_names_each_stage_of_the_start(tmp_path, monkeypatch):
  """A hang while the run starts is reported in its stage: the evaluation before RL is not
  'starting'."""
  from rlx import progress
  from rlx.trainer.learn import lifecycle

  seen = {}

  def evaluation(run, params):
    seen["evaluation"] = progress.snapshot()["doing"]
    return {}

  real_publish = lifecycle.Learner.publish

  def publish(learner):
    seen["publish"] = progress.snapshot()["doing"]
    return real_publish(learner)

  monkeypatch.setattr(lifecycle.Learner, "publish", publish)
  config = tiny.config("grpo_colocated", "--config.trainer.warmup_sft_steps=0")
  run = lifecycle.begin(config, tmp_path, say=lambda line: None, evaluate=evaluation).run
  try:
    assert "the held-out evaluation before RL" in seen["evaluation"], seen
    assert "publishing the first policy version" in seen["publish"], seen
  finally:
    run.close()


def test_a_run_killed_with_sigkill_leaves_nothing_its_environment_started(tmp_path):
  """An environment starts a sleeping process in a session of its own at every reset; SIGKILL
  of the trainer mid-run leaves none of them running 10 s later (``rlx.reaper``)."""
  import os
  import signal

  from tests.processes import left_after

  pids_file = tmp_path / "pids"
  pids_file.write_text("")
  command = [sys.executable, "-m", "rlx.main", "--config", "configs/agent_calc.py",
             "--workdir", str(tmp_path / "run"), *tiny.OVERRIDES, "--config.trainer.steps=200",
             "--config.mesh.mode=colocated",
             "--config.env.name=tests/trainer/flaky_env.py:make_forking_env",
             "--config.trainer.warmup_sft_steps=0", "--config.env.max_tokens=8",
             "--config.env.turn_max_new_tokens=4"]
  trainer = subprocess.Popen(command, cwd=tiny.ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL,
                             env=dict(os.environ, RLX_TEST_PIDS=str(pids_file)))
  try:
    deadline = time.monotonic() + 200
    while len(pids_file.read_text().split()) < 8 and time.monotonic() < deadline:
      assert trainer.poll() is None, "the run ended before its environment started"
      time.sleep(0.2)
  finally:
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
  pids = [int(p) for p in pids_file.read_text().split()]
  assert len(pids) >= 8

  left = left_after(pids, 10)
  assert not left, f"{len(left)} of the environment's {len(pids)} processes outlived the run"


@pytest.mark.parametrize("env", ["make_hung_env", "make_broken_env"])
def test_an_environment_whose_every_reset_fails_ends_the_run_at_start_in_one_line(env, tmp_path):
  """All resets hang or all raise: the run ends within one env.step_timeout_s of its start
  (the resets run at once, not one timeout after another), with one line naming the
  environment, the call and its first error."""
  command = [sys.executable, "-m", "rlx.main", "--config", "configs/agent_calc.py",
             "--workdir", str(tmp_path), *tiny.OVERRIDES, "--config.trainer.steps=2",
             "--config.mesh.mode=colocated", f"--config.env.name=tests/trainer/flaky_env.py:{env}",
             "--config.env.step_timeout_s=6", "--config.trainer.warmup_sft_steps=0",
             "--config.env.max_tokens=8", "--config.env.turn_max_new_tokens=4"]
  started = time.monotonic()
  result = subprocess.run(command, cwd=tiny.ROOT, capture_output=True, text=True, timeout=240)
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith("rlx: error")]
  assert len(errors) == 1, result.stderr[-3000:]
  assert "could not start: reset() failed on all 8 rows" in errors[0], errors
  assert ("did not return within env.step_timeout_s=6s" if env == "make_hung_env"
          else "ConnectionError: the simulator is not running") in errors[0], errors
  assert "Traceback" not in result.stderr
  assert time.monotonic() - started < 40  # not 8 timeouts of 6 s one after another
