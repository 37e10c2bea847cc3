"""The learner with ``trainer.pack_sequences`` and with ``trainer.share_prefix``: on a batch
split over eight devices, with two mini-batches, its update equals the unpacked learner's
(params and every metric) and it reports the padding it saved."""

import jax
import numpy as np

from rlx import update
from rlx.trainer import Draw, Learner, prepare
from tests.trainer import tiny
from tests.trainer.test_experience import _completion


def _learn(tmp_path, pack: bool, draw: Draw, share: bool = False, mini_batches: int = 2):
  config = tiny.config("dapo_split", "--config.trainer.warmup_sft_steps=0",
                       "--config.mesh.mode=colocated", "--config.data.prompts_per_step=16",
                       f"--config.trainer.mini_batches={mini_batches}",
                       "--config.rollout.max_new_tokens=32",
                       f"--config.trainer.pack_sequences={str(pack).lower()}",
                       f"--config.trainer.share_prefix={str(share).lower()}")
  run = prepare(config, tmp_path / f"{pack}-{share}", say=lambda line: None)
  try:
    learner = Learner.for_run(run, say=lambda line: None)
    assert update.row_ways(learner.batch_sharding) == 8  # the rows split over the devices
    metrics = learner.learn(draw)
    return metrics, jax.device_get(learner.state.params)
  finally:
    run.close()


def test_the_packed_learner_equals_the_unpacked_one(tmp_path):
  rng = np.random.default_rng(0)
  # short prompts, long-tailed responses of at most 32 tokens: rows of 40 slots that hold
  # several sequences each
  responses = [32] + list(np.minimum(16, 1 + rng.exponential(6, 31).astype(int)))
  completions = [_completion(rng.integers(1, 32, rng.integers(2, 9)), rng.integers(1, 32, n),
                             version=0, prompt_index=i // 2, sample_index=i % 2)
                 for i, n in enumerate(responses)]
  draw = Draw(completions=completions, rewards=rng.random(32).round().astype(np.float32),
              correct=np.ones(32, bool), counts={}, generate_seconds=0.0, data_state={})
  unpacked, unpacked_params = _learn(tmp_path, False, draw)
  packed, packed_params = _learn(tmp_path, True, draw)
  assert packed["train/packed_pad_frac"] < packed["train/pad_frac"] - 0.2
  assert packed.pop("train/packed_pad_frac") and "train/packed_pad_frac" not in unpacked
  assert packed.keys() == unpacked.keys()
  for name in unpacked:
    np.testing.assert_allclose(packed[name], unpacked[name], rtol=1e-4, atol=1e-6, err_msg=name)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               packed_params, unpacked_params)


def test_the_shared_prefix_learner_equals_the_unpacked_one(tmp_path):
  """Groups of 8 samples of one prompt each (long prompts, short answers): each group's prompt
  is forwarded once per packed row, and the update is the row-per-sample one."""
  rng = np.random.default_rng(1)
  completions = []
  for group in range(4):
    prompt = rng.integers(1, 32, rng.integers(20, 33))
    completions += [_completion(prompt, rng.integers(1, 32, rng.integers(1, 12)), version=0,
                                prompt_index=group, sample_index=i) for i in range(8)]
  draw = Draw(completions=completions, rewards=rng.random(32).round().astype(np.float32),
              correct=np.ones(32, bool), counts={}, generate_seconds=0.0, data_state={})
  unpacked, unpacked_params = _learn(tmp_path, False, draw, mini_batches=1)
  shared, shared_params = _learn(tmp_path, False, draw, share=True, mini_batches=1)
  assert shared.pop("train/shared_prefix_frac") > 0.3  # the prompts, once per packed row
  assert shared.pop("train/packed_pad_frac") < shared["train/pad_frac"]
  assert shared.keys() == unpacked.keys()
  for name in unpacked:
    np.testing.assert_allclose(shared[name], unpacked[name], rtol=1e-4, atol=1e-6, err_msg=name)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               shared_params, unpacked_params)
