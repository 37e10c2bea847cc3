"""The learner, shared by every loop: the policy's train state (and the critic's, for PPO),
the reference policy, the jitted programs (prepare, update, critic) with their shardings, and
the checkpoints (a run's start and end around it: ``rlx.trainer.learn.lifecycle``).

    metrics = learner.learn(draw, clip_eps_high=...)   # one rollout batch's updates

The same ``Learner.learn`` runs in every deployment: the loss code never knows how fresh its
data is beyond what each rollout's policy version says.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rlx import algorithms, distributed, progress, update
from rlx.checkpoint import Checkpointer, CheckpointError
from rlx.config import RunConfig
from rlx.models import Model, lora
from rlx.sync import WeightSync
from rlx.update import packing
from rlx.trainer import control
from rlx.trainer.draw import Draw
from rlx.trainer.common import NonFiniteError, Say
from rlx.trainer.setup.policy_files import initial_adapters, write_policy
from rlx.trainer.setup.run import Run, base_reference
from rlx.trainer.learn.experience import make_prepare, sample_arrays
from rlx.trainer.learn.health import skip_cause


class Learner:
  """The policy's train state (and the critic's, for PPO), the reference policy, the jitted
  steps and the checkpoints; ``learn`` turns a draw into one update."""

  def __init__(self, config: RunConfig, model: Model, learning_mesh, sync: WeightSync, *,
               pad_id: int, directory: pathlib.Path, say: Say = print,
               base_reference: dict | None = None, owned: bool = False):
    """``model``: the policy to start from (its params on ``learning_mesh``; ``owned``: the
    learner takes them, and without LoRA the train state holds them in their place: they are
    deleted for the caller); ``sync``: where new versions are published; ``directory``: the
    checkpoints' home."""
    self.config = config
    self.say = say
    self.sync, self.pad_id = sync, pad_id
    updates = config.trainer.steps * config.trainer.ppo_epochs * config.trainer.mini_batches
    optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=updates)
    algo, transformer = config.algorithm, model.transformer
    # One sharding plan: the params' logical axes and the batch's rows over (data, fsdp); every
    # jitted program of the learner has explicit shardings, so none retraces as steps go by.
    self.batch_sharding = update.batch_sharding(
        learning_mesh, config.mesh.logical_axis_rules,
        config.data.prompts_per_step * config.rollout.group_size)
    if not update.batch_is_split(self.batch_sharding) and learning_mesh.size > 1:
      say(f"rlx: warning: a batch of {config.data.prompts_per_step * config.rollout.group_size} "
          f"sequences does not split over the learning mesh {dict(learning_mesh.shape)}: "
          "every learning device computes the whole batch; make data.prompts_per_step x "
          "rollout.group_size a multiple of mesh data x fsdp")
    # the learner's programs keep their activations' rows where the batch's rows are
    transformer = dataclasses.replace(transformer, row_sharding=self.batch_sharding)
    self.model = model
    self.base = None
    """With LoRA (``model.lora``): the frozen base the adapters (``state.params``) sit on."""
    trainable = model.params
    if config.model.lora.enabled:
      self.base, trainable = model.params, initial_adapters(config, model, learning_mesh)
    # the reference is the starting policy: with fresh LoRA adapters (adding 0) the base itself
    self.ref_params = None
    if algo.uses_reference and self.base is None:
      self.ref_params = jax.tree.map(jnp.copy, model.params)
    critic_params = (jax.tree.map(jnp.copy, model.params) if algo.uses_critic else None)
    self.state = update.init_train_state(trainable, optimizer,
                                         jax.random.key(config.trainer.seed),
                                         donate=owned and self.base is None)
    self.state_shardings = jax.tree.map(lambda x: x.sharding, self.state)
    if self.base is None:  # its params are the state's now; what reads them reads those
      self.model = model.replace(params=None)
    base_shardings = (None if self.base is None
                      else jax.tree.map(lambda x: x.sharding, self.base))
    if algo.uses_reference and self.base is not None:
      self.ref_params = self.base if config.model.lora.path is None else lora.combine(
          self.base, jax.tree.map(jnp.copy, self.state.params))
    self.critic = self.critic_step = None
    critic_shardings = None
    if algo.uses_critic:
      critic_optimizer, _ = update.make_optimizer(
          config.optimizer, total_steps=updates,
          peak=config.optimizer.critic_learning_rate)
      critic_params = update.init_critic_params(critic_params,
                                                jax.random.key(config.trainer.seed + 1))
      self.critic = update.init_train_state(critic_params, critic_optimizer,
                                            jax.random.key(config.trainer.seed + 1))
      critic_state_shardings = jax.tree.map(lambda x: x.sharding, self.critic)
      critic_shardings = critic_state_shardings.params
      self.critic_step = update.make_critic_step(config, transformer, critic_optimizer,
                                                 state_shardings=critic_state_shardings,
                                                 batch_shardings=self.batch_sharding)
    self.step_fn = update.make_update_step(config, transformer, optimizer, schedule,
                                           state_shardings=self.state_shardings,
                                           batch_shardings=self.batch_sharding,
                                           frozen_shardings=base_shardings)
    policy_shardings = lora.combine(base_shardings, self.state_shardings.params) \
        if self.base is not None else self.state_shardings.params
    self.prepare_fn = make_prepare(config, transformer, param_shardings=policy_shardings,
                                   ref_shardings=(None if self.ref_params is None else
                                                  jax.tree.map(lambda x: x.sharding,
                                                               self.ref_params)),
                                   critic_shardings=critic_shardings,
                                   batch_sharding=self.batch_sharding)
    self.kl_coef = algo.kl_coef
    self.entropy_coef = algo.entropy_coef
    """The entropy bonus's coefficient (moved by ``algorithm.entropy_target``)."""
    self.entropy_below_target = True
    """With ``algorithm.entropy_target``: whether the last step's entropy was below it (the
    bonus applies only then)."""
    self._lengths_and_order = None  # jitted on the first packed step
    self.skipped_steps = 0
    """Updates skipped so far (non-finite loss or gradient norm): ``train/skipped_steps``."""
    self.moved = None  # whether the last update moved the params (None: none ran yet)
    self.skipped_in_a_row = 0
    self.saved_step = None
    """The step of the newest save started by this learner (it may still be writing)."""
    self.restored_meta: dict = {}
    """The metadata of the checkpoint the learner resumed from (empty on a fresh run)."""
    largest = max(x.nbytes for x in jax.tree.leaves((self.state, self.critic))
                  if hasattr(x, "nbytes"))
    self.checkpointer = Checkpointer(directory, config.checkpoint, largest_bytes=largest)
    self.base_reference = base_reference
    """With LoRA: the base's ``{"path", "fingerprint"}``, saved with each checkpoint; a resume
    onto another base is refused."""
    self.releases_generation_copy = config.mesh.mode == "colocated"
    """Whether ``learn`` lets go of the generator's copy of the weights (``WeightSync.release``)
    until the next ``publish``: colocated, nothing samples meanwhile, and the update takes its
    memory (SmolLM2-135M on two CPU devices: 1.1 GB, one copy per device)."""

  @classmethod
  def for_run(cls, run: Run, say: Say = print) -> Learner:
    """The learner of ``run``: its model, learning mesh, weight sync and checkpoints."""
    reference = (base_reference(run.config, run.workdir) if run.config.model.lora.enabled
                 else None)
    # the train state takes the run's weights: a copy beside it would be a second one for the
    # whole run (0.5 GB on a 135M model)
    return cls(run.config, run.model, run.meshes.learning, run.sync,
               pad_id=run.tokenizer.pad_id, directory=run.workdir / "checkpoints", say=say,
               base_reference=reference, owned=True)

  @property
  def version(self) -> int:
    return int(self.state.policy_version)

  def policy_params(self):
    """The policy's whole params: the trained params, or with LoRA the base with the adapters
    beside it (run unmerged)."""
    return lora.combine(self.base, self.state.params) if self.base is not None \
        else self.state.params

  def export(self, directory: pathlib.Path, tokenizer, merged: bool | None = None) -> list:
    """Writes the policy under ``directory`` (``write_policy``); ``merged`` defaults to
    ``checkpoint.export_merged``."""
    if merged is None:
      merged = self.config.checkpoint.export_merged
    return write_policy(self.config, self.model, self.state.params, tokenizer, directory,
                        base=self.base, merged=merged)

  def restore(self, usable=None):
    """Resumes the train state from the newest usable checkpoint (``Checkpointer.restore``),
    if any; returns what was restored (its ``step``, ``data_state`` and ``meta``), or None on
    a fresh run."""
    self._check_adapters()
    restored = self.checkpointer.restore(self.state, like_critic=self.critic, say=self.say,
                                         usable=usable)
    if restored is None:
      return None
    saved = restored.meta.get("lora_base")
    if self.base_reference is not None and saved is not None and (
        saved.get("fingerprint") != self.base_reference["fingerprint"]):
      raise CheckpointError(
          f"the checkpoint at step {restored.step} holds LoRA adapters trained on the base "
          f"{saved.get('path')} (fingerprint {saved.get('fingerprint')}), but this run's base is "
          f"{self.base_reference['path']} (fingerprint {self.base_reference['fingerprint']}): "
          "resume with the model the adapters belong to, or start a new workdir")
    self.state, self.critic = restored.state, restored.critic
    self.kl_coef = restored.meta.get("kl_coef", self.kl_coef)
    self.entropy_coef = restored.meta.get("entropy_coef", self.entropy_coef)
    # a resume continues the skip count: a rerun that skips again stops after the streak's
    # remainder, not after a fresh max_skipped_steps
    self.skipped_steps = int(restored.meta.get("skipped_steps", 0))
    self.skipped_in_a_row = int(restored.meta.get("skipped_in_a_row", 0))
    self.saved_step = restored.step
    self.restored_meta = restored.meta
    return restored

  def _check_adapters(self) -> None:
    """Refuses, in one line, a resume whose LoRA settings differ from the newest
    checkpoint's (``lora.resume_problem``), before its state is read."""
    found = self.checkpointer.read_meta()
    if found is None or "lora" not in found[1]:  # none, or written before it was recorded
      return
    problem = lora.resume_problem(found[1]["lora"], self.config.model.lora)
    if problem:
      raise CheckpointError(f"the checkpoint at step {found[0]} in {self.checkpointer.directory} "
                            f"does not fit this run's adapters ({problem}): resume with the "
                            "values it was trained with, or start a new workdir")

  def save(self, step: int, data_state: dict, **meta) -> None:
    """Starts saving ``step`` (with ``meta`` beside the learner's own: version, KL
    coefficient, data fingerprint; with LoRA the base's path and fingerprint: the checkpoint
    holds the adapters and their optimizer state only)."""
    self.saved_step = step
    if self.base_reference is not None:
      meta = dict(meta, lora_base=self.base_reference)
    self.checkpointer.save(step, self.state, critic=self.critic, data_state=data_state,
                           meta={"policy_version": self.version, "kl_coef": self.kl_coef,
                                 "lora": lora.record(self.config.model.lora),
                                 "entropy_coef": self.entropy_coef,
                                 "skipped_steps": self.skipped_steps,
                                 "skipped_in_a_row": self.skipped_in_a_row, **meta})

  def publish(self) -> float:
    """Hands the current params to the generator; returns the sync's seconds. The sync refuses
    a new version bitwise the last one when the update that made it moved the params."""
    progress.doing(f"publishing policy version {self.version}")
    return self.sync.publish(self.state.params, self.version, changed=self.moved)

  @property
  def sync_bytes(self) -> int:
    """The bytes the last ``publish`` shipped (with LoRA, the adapters only)."""
    return self.sync.last_bytes

  @property
  def sync_verified(self) -> int:
    """How many versions the sync has checked where they landed (``rlx.sync.check_landed``)."""
    return self.sync.verified

  def generation_params(self):
    """The newest published params, in the generation layout."""
    return self.sync.latest()[0]

  def release_generation_copy(self) -> None:
    """Lets go of the generator's copy of the weights until the next ``publish``
    (``WeightSync.release``): nothing samples before it."""
    self.sync.release()

  def learn(self, draw: Draw, *, clip_eps_high: float | None = None) -> dict:
    """The policy's updates on ``draw`` (``trainer.ppo_epochs`` passes of
    ``trainer.mini_batches`` optimizer steps, one jitted call), and the critic's. Colocated,
    the generator's copy of the weights goes first (``releases_generation_copy``): the caller
    publishes the new version before anything samples again.

    ``clip_eps_high``: the upper clip range (an entropy controller may raise it; None:
    ``algorithm.clip_eps_high``), a traced input of the step like each batch's sampling
    temperature, so neither recompiles."""
    config = self.config
    progress.doing(f"the update that makes policy version {self.version + 1}")
    if self.releases_generation_copy:
      self.release_generation_copy()
    if clip_eps_high is None:
      clip_eps_high = config.algorithm.eps_high
    # every process lays its rows out at the same (bucketed) lengths: the batch is one array
    lengths = distributed.max_over_processes(
        [max(len(c.prompt_tokens) for c in draw.completions),
         max(len(c.response_tokens) for c in draw.completions)])
    temperature = config.rollout.temperature if draw.temperature is None else draw.temperature
    sampled, stats = sample_arrays(draw.completions, draw.rewards, config,
                                   pad_id=self.pad_id, lengths=tuple(lengths),
                                   temperature=temperature)
    version = self.version  # the params that train on it (the update below advances it)
    lag_mean, lag_max = control.lag(sampled.policy_version, version)
    pad_frac = packing.pad_fraction(sampled.attention_mask.sum(1), sampled.attention_mask.size)
    sampled = distributed.global_tree(self.batch_sharding, sampled)
    plans, packed = (self._packing(sampled)
                     if config.trainer.pack_sequences or config.trainer.share_prefix
                     else ((None, None), {}))
    with progress.running("the update step"):
      batch = self.prepare_fn(self.policy_params(), self.ref_params,
                              None if self.critic is None else self.critic.params, sampled,
                              self.kl_coef, packing=plans[0])
      metrics = dict(packed)
      if self.critic is not None:
        self.critic, critic_metrics = self.critic_step(self.critic, batch)
        metrics.update(critic_metrics)
      self.state, step_metrics = self.step_fn(
          self.state, batch, self.kl_coef, clip_eps_high,
          self.entropy_coef if self.entropy_below_target else 0.0, frozen=self.base,
          packing=plans[1])
      metrics.update(step_metrics)
      metrics = distributed.to_host(metrics)  # replicated: the same values on every process
    self.moved = bool(metrics.get("optim/update_ratio", 0.0) > 0
                      and metrics.get("train/skipped", 0) < metrics.get("train/updates", 1))
    self._count_skipped(int(metrics.pop("train/skipped")), metrics, draw)
    # the engine against the learner on the rows the current params sampled (none: no figure),
    # unless the producer measured it at hand-over (split: the draw carries it): one figure a
    # batch, from one place
    mismatch, tokens = metrics.pop("rollout/mismatch_kl_sum"), metrics.pop("rollout/mismatch_tokens")
    if tokens > 0 and "rollout/mismatch_kl" not in draw.counts:
      metrics["rollout/mismatch_kl"] = float(mismatch / tokens)
    algo = config.algorithm
    if algo.entropy_target is not None:
      self.entropy_below_target = metrics["policy/entropy"] < algo.entropy_target
      self.entropy_coef = float(algorithms.adaptive_entropy_coef(
          self.entropy_coef, metrics["policy/entropy"], algo.entropy_target,
          algo.entropy_coef_step))
    if algo.kl_target is not None and "policy/kl" in metrics:
      self.kl_coef = float(algorithms.adaptive_kl_coef(
          self.kl_coef, metrics["policy/kl"], algo.kl_target, algo.kl_horizon,
          steps=batch.batch_size))
    # this process's rows: every process has as many, so means of means are exact
    means = dict(stats, **{"reward/kept_accuracy": float(np.mean(draw.correct)),
                           "rollout/policy_lag_mean": lag_mean,
                           "rollout/token_lag_mean": control.token_lag(draw.completions, version),
                           "train/pad_frac": pad_frac})
    maxima = {"response/length_max": stats.pop("response/length_max"),
              "rollout/policy_lag_max": lag_max}
    means.pop("response/length_max")
    totals = distributed.sum_over_processes(list(means.values())) / jax.process_count()
    metrics.update(zip(means, map(float, totals)))
    metrics.update(zip(maxima, map(int, distributed.max_over_processes(list(maxima.values())))))
    metrics.update(draw.counts)
    if algo.entropy_floor is not None and algo.entropy_control == "temperature":
      metrics["rollout/temperature"] = temperature  # what the data was sampled at
    metrics["train/skipped_steps"] = self.skipped_steps
    progress.tick()
    return metrics

  def _packing(self, sampled) -> tuple[tuple[update.Packing | None, update.Packing | None],
                                         dict[str, float]]:
    """The packing (``rlx.update.packing``) of prepare's chunks and of the update's schedule
    for the global batch ``sampled``, made from the rows' lengths, their shared prefixes
    (``trainer.share_prefix``) and the schedule's order, the same on every process; and
    ``train/packed_pad_frac``, the padding of the rows the update's forward passes run on (the
    unpacked layout's where packing saves nothing), and ``train/shared_prefix_frac``, the share
    of the rows' real tokens that sharing prefixes left out of them."""
    trainer = self.config.trainer
    micro = self.config.optimizer.micro_batches
    replicated = NamedSharding(self.batch_sharding.mesh, PartitionSpec())
    if self._lengths_and_order is None:
      def lengths_and_order(sampled, key, step):
        order = update.minibatch_order(sampled.attention_mask.shape[0],
                                       jax.random.fold_in(key, step),
                                       epochs=trainer.ppo_epochs, mini_batches=trainer.mini_batches)
        links = packing.shared_prefixes(sampled.tokens, sampled.attention_mask,
                                        sampled.response_mask)
        return sampled.attention_mask.sum(1, dtype=jnp.int32), order, links
      self._lengths_and_order = jax.jit(lengths_and_order, out_shardings=replicated)
    lengths, order, links = distributed.to_host(self._lengths_and_order(
        sampled, self.state.key, self.state.step))
    if not trainer.share_prefix or not links.any():
      links = None
    capacity = sampled.attention_mask.shape[1]
    ways = update.row_ways(self.batch_sharding) if update.batch_is_split(self.batch_sharding) else 1
    plan = lambda make, *args: (make(*args, ways, links=links)
                                if links is not None or trainer.pack_sequences else None)
    chunks = plan(packing.chunk_plan, lengths, trainer.mini_batches * micro, capacity)
    schedule = plan(packing.schedule_plan, lengths, order, micro, capacity)
    real = placed = int(lengths[order].sum())  # the tokens each update pass runs on
    slots = order.size * capacity
    if schedule is not None:
      slots = schedule.row.shape[0] * micro * schedule.rows * (schedule.width or capacity)
      if schedule.prefix is not None:  # a follower skips its group's prefix
        followers = schedule.lead != np.arange(schedule.lead.shape[-1])
        placed -= int(np.where(followers, schedule.prefix, 0).sum())
    metrics = {"train/packed_pad_frac": 1.0 - placed / max(slots, 1)}
    if trainer.share_prefix:
      metrics["train/shared_prefix_frac"] = 1.0 - placed / max(real, 1)
    to_device = lambda plan: None if plan is None else jax.tree.map(
        lambda x: distributed.global_array(replicated, x), plan)
    return (to_device(chunks), to_device(schedule)), metrics

  def _count_skipped(self, skipped: int, metrics: dict, draw: Draw) -> None:
    """Counts updates skipped for a non-finite loss, gradient or update; stops the run after
    ``trainer.max_skipped_steps`` in a row, naming the likely cause."""
    self.skipped_steps += skipped
    self.skipped_in_a_row = self.skipped_in_a_row + skipped if skipped else 0
    limit = self.config.trainer.max_skipped_steps
    if self.skipped_in_a_row >= limit:
      self.checkpointer.wait()
      last = self.checkpointer.latest_step()
      saved = (f"the last good checkpoint is step {last} in {self.checkpointer.directory}"
               if last is not None else "no checkpoint was saved yet")
      raise NonFiniteError(
          f"{self.skipped_in_a_row} updates in a row were skipped, non-finite (config.trainer."
          f"max_skipped_steps={limit}): {skip_cause(metrics, draw, self.config)}; {saved}")

  def close(self) -> None:
    self.checkpointer.close()


