"""The learner is data-parallel: its real programs, compiled on an 8-device (data 2 x fsdp 4)
mesh, take the batch split over (data, fsdp), keep Adam's moments sharded like the params,
and gather the FSDP params instead of replicating the batch."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from rlx.trainer import Draw, Learner, prepare
from tests.trainer import tiny
from tests.trainer.test_experience import _completion


def test_the_learners_compiled_step_is_data_parallel(tmp_path):
  config = tiny.config("ppo_colocated", "--config.trainer.warmup_sft_steps=0",
                       "--config.data.prompts_per_step=8", "--config.mesh.data=2",
                       "--config.mesh.fsdp=-1", "--config.mesh.cpu_devices=8",
                       "--config.trainer.mini_batches=2")
  run = prepare(config, tmp_path, say=lambda line: None)
  try:
    learner = Learner.for_run(run, say=lambda line: None)
    assert dict(run.meshes.learning.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert learner.batch_sharding.spec == P(("data", "fsdp"))
    rng = np.random.default_rng(0)
    completions = [_completion(rng.integers(1, 32, 5), rng.integers(1, 32, 6)) for _ in range(16)]
    draw = Draw(completions=completions, rewards=rng.random(16).round().astype(np.float32),
                correct=np.ones(16, bool), counts={}, generate_seconds=0.0, data_state={})
    metrics = learner.learn(draw)  # the real path runs
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["critic/loss"])

    # Adam's moments (and the critic's) lie exactly like their params, not replicated
    for state in (learner.state, learner.critic):
      adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
              if hasattr(s, "mu")]
      assert len(adam) == 1
      for moment in (adam[0].mu, adam[0].nu):
        jax.tree.map(lambda m, p: _same_sharding(m, p), moment, state.params)
    sharded = [x for x in jax.tree.leaves(learner.state.params) if x.sharding.spec != P()]
    assert sharded  # FSDP shards some params

    # the compiled step: the state and the batch enter in the learner's shardings, split rows
    batch = learner.prepare_fn(learner.state.params, learner.ref_params, learner.critic.params,
                               _sampled(learner, draw), learner.kl_coef)
    assert batch.tokens.sharding.spec == P(("data", "fsdp"))
    assert {shard.data.shape[0] for shard in batch.tokens.addressable_shards} == {2}  # 16 / 8
    compiled = learner.step_fn.jitted.lower(
        learner.state, batch, np.float32(learner.kl_coef),
        np.float32(config.algorithm.eps_high), np.float32(0.0), None, None).compile()
    state_in, batch_in, *_ = compiled.input_shardings[0]
    jax.tree.map(lambda s, p: _same_sharding(s, p), state_in.params, learner.state.params)
    assert all(s.spec == P(("data", "fsdp")) for s in jax.tree.leaves(batch_in))
    assert "all-gather" in compiled.as_text()  # FSDP gathers params, each device its own rows
  finally:
    run.close()


def _same_sharding(array_or_sharding, param):
  sharding = getattr(array_or_sharding, "sharding", array_or_sharding)
  assert sharding.is_equivalent_to(param.sharding, param.ndim), (sharding, param.sharding)


def _sampled(learner, draw):
  from rlx import distributed
  from rlx.trainer import sample_arrays

  sampled, _ = sample_arrays(draw.completions, draw.rewards, learner.config,
                             pad_id=learner.pad_id)
  return distributed.global_tree(learner.batch_sharding, sampled)
