"""The path a user with their own model, data and reward takes: no toy warm-up on a real
checkpoint, held-out evaluation on file data, a reward function from a file with its
components logged, and the shipped examples and code config."""

import json
import subprocess
import sys

import pytest

from rlx.trainer import prepare
from rlx.trainer.setup.warmup import warms_up
from tests.trainer import tiny

QWEN2 = "tests/fixtures/hf/qwen2"


def test_a_checkpoint_gets_no_warm_up_unless_asked():
  # the base config asks for warm-up steps (tiny.OVERRIDES: 2), meant for the built-in model
  assert warms_up(tiny.config("grpo_colocated"))
  assert not warms_up(tiny.config("grpo_colocated", f"--config.model.path={QWEN2}"))
  assert warms_up(tiny.config("grpo_colocated", f"--config.model.path={QWEN2}",
                              "--config.trainer.warmup_sft=always"))
  assert not warms_up(tiny.config("grpo_colocated", "--config.trainer.warmup_sft=never"))
  assert not warms_up(tiny.config("grpo_colocated", "--config.trainer.warmup_sft_steps=0"))


def test_a_warm_up_that_makes_the_weights_non_finite_saves_nothing(tmp_path):
  from rlx.trainer import NonFiniteError

  with pytest.raises(NonFiniteError, match="warm-up made the weights NaN or inf.*nothing was "
                                           "saved.*warmup_sft_learning_rate"):
    prepare(tiny.config("grpo_colocated", "--config.trainer.warmup_sft_learning_rate=3e38",
                        "--config.trainer.warmup_sft_steps=4"),
            tmp_path, say=lambda message: None)
  assert not (tmp_path / "warmup").exists()


def test_file_data_holds_out_rows_for_evaluation_and_never_trains_on_them(tmp_path):
  data = tmp_path / "d.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"q{i}?", "answer": str(i)}) + "\n"
                          for i in range(200)))
  said = []
  run = prepare(tiny.config("grpo_colocated", f"--config.data.source={data}",
                            "--config.data.eval_fraction=0.2", "--config.trainer.eval_prompts=500"),
                tmp_path / "run", say=said.append)
  run.close()
  held = {row["prompt"] for row in run.eval_rows}
  trained = {run.source[i]["prompt"] for i in range(len(run.source))}
  assert 20 < len(held) < 60 and len(held) + len(trained) == 200 and not held & trained
  assert any(f"{len(held)} of the 200 rows of {data} are held out" in line for line in said)
  evaluation = tmp_path / "eval.jsonl"
  evaluation.write_text(json.dumps({"prompt": "held?", "answer": "1"}) + "\n")
  run = prepare(tiny.config("grpo_colocated", f"--config.data.source={data}",
                            f"--config.data.eval_source={evaluation}"), tmp_path / "run2",
                say=said.append)
  run.close()
  assert [row["prompt"] for row in run.eval_rows] == ["held?"] and len(run.source) == 200


def _main(*args, timeout=900):
  return subprocess.run([sys.executable, "-m", "rlx.main", *args], capture_output=True, text=True,
                        timeout=timeout, cwd=tiny.ROOT)


def test_the_user_reward_example_trains_with_held_out_eval_and_logs_components(tmp_path):
  result = _main("--config", "examples/user_reward/config.py", "--workdir", str(tmp_path),
                 *tiny.OVERRIDES, "--config.trainer.steps=2", "--config.trainer.eval_every=1",
                 "--config.rollout.max_prompt_len=112", "--config.reward.num_workers=1",
                 "--config.trainer.eval_samples=2")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "are held out for evaluation" in result.stdout
  rows = tiny.metrics(tmp_path)
  assert len(rows) == 2 and "eval/accuracy" in rows[0] and "eval/pass@2" in rows[0]
  assert rows[0]["reward/format"] >= 0 and "reward/errors" in rows[0]
  assert any(key.startswith("reward/correct_") for key in rows[0]), sorted(rows[0])


def test_a_reward_that_cannot_be_imported_stops_the_run_before_the_model(tmp_path):
  result = _main("--config", "configs/grpo_colocated.py", "--workdir", str(tmp_path),
                 "--config.reward.name=missing_rewards.py:score", timeout=300)
  assert result.returncode == 2 and "missing_rewards.py does not exist" in result.stderr
  assert "Traceback" not in result.stderr and "warm-up" not in result.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the code sandbox")
def test_the_code_reward_on_rows_without_tests_stops_before_training(tmp_path):
  result = _main("--config", "configs/grpo_colocated.py", "--workdir", str(tmp_path),
                 "--config.reward.name=code", timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "has no field 'tests'" in result.stderr and "code_tests_field" in result.stderr
  assert "Traceback" not in result.stderr and "warm-up" not in result.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the code sandbox")
def test_the_code_config_trains_on_the_sandboxed_code_reward(tmp_path):
  from tests.trainer.tiny import config

  from rlx.trainer import train

  train(config("code_grpo", "--config.trainer.steps=2", "--config.rollout.max_new_tokens=16",
               "--config.rollout.max_prompt_len=80", "--config.trainer.eval_every=2",
               "--config.algorithm.dynamic_sampling=false"),  # an untrained model: all 0
        tmp_path, say=lambda message: None)
  rows = tiny.metrics(tmp_path)
  assert len(rows) == 2 and "eval/accuracy" in rows[-1]
  assert rows[0]["reward/ran"] >= 0 and rows[0]["reward/errors"] == 0


def test_scoring_overlaps_generation_and_gives_what_scoring_afterwards_gives(tmp_path):
  from rlx.trainer.produce.collect import generate_and_score

  run = prepare(tiny.config("grpo_colocated", "--config.reward.name=tests.trainer.toy_rewards:odd_length",
                            "--config.rollout.max_new_tokens=12", "--config.rollout.max_slots=4"),
                tmp_path, say=lambda message: None)
  scored_at = []
  score = run.pool.score

  def recording(texts, rows):
    scored_at.append(len(texts))
    return score(texts, rows)

  run.pool.score = recording
  rows = [next(run.stream)[0] for _ in range(3)]
  completions, scored = generate_and_score(run, run.model.params, rows, n=4, temperature=1.0,
                                           seed=3, version=0)
  run.pool.score = score
  texts = [run.tokenizer.decode(c.response_tokens) for c in completions]
  again = run.pool.score(texts, [rows[c.prompt_index] for c in completions])
  run.close()
  assert sum(scored_at) == 12 and len(scored_at) > 1  # scored in parts, while decoding
  assert (scored.rewards == again.rewards).all() and (scored.correct == again.correct).all()
