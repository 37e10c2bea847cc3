"""What users keep across the trainer's move into wings: a rollout file and a checkpoint written
by the trainer before it (``tests/fixtures/premove``, made by its ``make.py`` at that commit)
are read by today's code, the file byte for byte."""

import pathlib
import shutil

from rlx.checkpoint import Checkpointer
from rlx.trainer import train
from rlx.trainer.draw import decode, encode
from tests.trainer import tiny

FIXTURE = pathlib.Path(__file__).parent.parent / "fixtures" / "premove"


def test_a_rollout_file_written_before_the_move_reads_back_and_encodes_to_the_same_bytes():
  data = (FIXTURE / "rollouts" / "00000007.rollout").read_bytes()
  draw, extra = decode(data)
  assert extra == {"generator": 0, "seed": 11}
  c = draw.completions
  assert [x.response_tokens for x in c] == [[8, 9], [10, 11, 12, 13], [3, 4, 5], [6]]
  assert c[1].sampled_mask == [True, False, False, True] and c[1].turns == 2
  assert c[2].versions() == [2, 3, 3] and c[2].finish_reason == "length"
  assert c[0].policy_logprobs == [-0.5, -0.125]
  assert draw.rewards.tolist() == [1.0, 0.0, 0.5, 0.0] and draw.correct.tolist()[0]
  assert draw.counts == {"reward/mean": 0.375, "rollout/draws": 1}
  assert draw.data_state == {"next_index": 4, "epoch": 0} and draw.temperature == 1.0
  assert encode(draw, extra) == data


def test_a_checkpoint_written_before_the_move_resumes_after_it(tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(FIXTURE / "run", workdir)
  _, before = Checkpointer(workdir / "checkpoints").read_meta()
  said = []
  # (the shipped config's warm-up now stops at a share of answers right; the fixture's did not)
  config = tiny.config("grpo_colocated", "--config.trainer.steps=3",
                       "--config.checkpoint.every_steps=1", "--config.trainer.eval_prompts=0",
                       "--config.trainer.warmup_sft_until=0")
  summary = train(config, workdir, say=said.append)
  assert any("resumed from" in line and "at step 2" in line for line in said), said
  assert not any("warming up again" in line for line in said), said  # its warm-up reused
  assert summary.first_step == 2 and summary.steps == 3
  step, after = Checkpointer(workdir / "checkpoints").read_meta()
  # the same keys, and the skipped-update counts that came in before the move (exploded
  # updates skipped), not with it
  assert step == 3 and set(after) == set(before) | {"skipped_steps", "skipped_in_a_row"}
  assert after["policy_version"] == before["policy_version"] + 1
