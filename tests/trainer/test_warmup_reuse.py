"""A saved supervised warm-up is reused only when it was made with the run's settings: a
changed warm-up setting redoes it (the old one kept aside), never a silent reuse."""

from rlx.trainer import prepare
from rlx.trainer.setup.warmup import FINGERPRINT
from tests.trainer import tiny


def test_a_warm_up_made_with_other_settings_is_redone_and_the_old_one_kept(tmp_path):
  said = []
  run = prepare(tiny.config("base"), tmp_path, say=said.append)
  run.close()
  assert (tmp_path / "warmup" / FINGERPRINT).is_file()
  assert any("supervised warm-up: 2 steps" in line for line in said)

  said.clear()
  run = prepare(tiny.config("base"), tmp_path, say=said.append)  # the same settings: reused
  run.close()
  assert any("loading the warmed-up model" in line for line in said), said

  said.clear()
  run = prepare(tiny.config("base", "--config.trainer.warmup_sft_steps=3"), tmp_path,
                say=said.append)
  run.close()
  line = next(line for line in said if "made with other settings" in line)
  assert "trainer.warmup_sft_steps: 2 -> 3" in line
  assert any("supervised warm-up: 3 steps" in line for line in said), said
  assert len(list(tmp_path.glob("warmup.stale-*"))) == 1  # nothing the user saved is lost
