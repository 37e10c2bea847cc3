"""The colocated deployment end to end at a tiny size: it trains, writes metrics and checkpoints,
and a run stopped and resumed gives the same metrics as one that ran straight through."""

import dataclasses
import json

import pytest

from rlx.config import ArchConfig, RunConfig
from rlx.trainer.deploy.colocated import train_colocated

TINY = ArchConfig(num_layers=1, vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=2,
                  num_kv_heads=1, head_dim=16)


def _config(steps, **algorithm):
  c = RunConfig()
  return dataclasses.replace(
      c, model=dataclasses.replace(c.model, arch=TINY, remat="none"),
      rollout=dataclasses.replace(c.rollout, max_prompt_len=64, max_new_tokens=8, group_size=2,
                                  max_slots=8),
      algorithm=dataclasses.replace(c.algorithm, **algorithm),
      data=dataclasses.replace(c.data, prompts_per_step=2),
      reward=dataclasses.replace(c.reward, num_workers=0, format_weight=0.5),
      optimizer=dataclasses.replace(c.optimizer, learning_rate=1e-3),
      checkpoint=dataclasses.replace(c.checkpoint, every_steps=1, async_save=False),
      logging=dataclasses.replace(c.logging, progress_bar=False, tensorboard=False),
      trainer=dataclasses.replace(c.trainer, steps=steps, warmup_sft_steps=2, warmup_sft_batch=4,
                                  eval_prompts=4))


def _metrics(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_equals_straight_run(tmp_path):
  straight = train_colocated(_config(3, kl_coef=0.05), tmp_path / "straight", say=lambda *a: None)
  assert straight.steps == 3 and straight.eval_accuracy_after is not None
  train_colocated(_config(2, kl_coef=0.05), tmp_path / "resumed", say=lambda *a: None)
  train_colocated(_config(3, kl_coef=0.05), tmp_path / "resumed", say=lambda *a: None)
  a, b = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
  assert [m["step"] for m in b] == [1, 2, 3]
  for left, right in zip(a, b):
    for key in ("loss", "reward/mean", "policy/kl", "policy/entropy", "response/length_mean"):
      assert left[key] == pytest.approx(right[key], rel=1e-5, abs=1e-7), key
  for key in ("reward/mean", "reward/accuracy", "response/length_mean", "policy/kl",
              "policy/entropy", "policy/clip_frac_high", "rollout/policy_lag_max", "time/step_s",
              "time/sync_s", "throughput/tokens_per_s"):
    assert key in a[0]
  assert (tmp_path / "straight" / "checkpoints").is_dir()
