"""Weight sync learner -> generator: reshard and Orbax give identical generator params, in the
generation shardings; versions, staleness queries and garbage collection."""

import chex
import jax
import pytest

from rlx import mesh as mesh_lib
from rlx import sync
from rlx.config import ArchConfig, MeshConfig
from rlx.models import init_model, param_shardings
from rlx.models.transformer import init_params

ARCH = ArchConfig(num_layers=2, vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4,
                  num_kv_heads=2, head_dim=8)
RULES = MeshConfig().logical_axis_rules


@pytest.fixture(scope="module")
def meshes():
  return mesh_lib.make_meshes(MeshConfig(mode="split", generation_devices=2, generation_tensor=2))


def _learner_params(meshes, seed):
  return init_model(ARCH, jax.random.key(seed), mesh=meshes.learning).params


def test_reshard_and_orbax_give_identical_generator_params(meshes, tmp_path):
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))
  reshard = sync.ReshardSync(generation)
  orbax = sync.OrbaxSync(tmp_path / "weights", generation, like=like)
  try:
    for version in (1, 2, 3):
      params = _learner_params(meshes, version)
      assert reshard.publish(params, version) > 0 and orbax.publish(params, version) > 0
    via_reshard, v1 = reshard.latest(newer_than=0)
    via_orbax, v2 = orbax.latest(newer_than=0)
    assert v1 == v2 == 3
    chex.assert_trees_all_equal(jax.device_get(via_reshard), jax.device_get(via_orbax))
    chex.assert_trees_all_equal(jax.device_get(via_orbax), jax.device_get(params))
    for array, sharding in zip(jax.tree.leaves(via_orbax), jax.tree.leaves(generation)):
      assert array.sharding == sharding
    generation_devices = set(meshes.generation.devices.flat)
    assert {d for a in jax.tree.leaves(via_reshard) for d in a.devices()} <= generation_devices
    assert orbax.versions() == [2, 3]  # older versions are deleted
  finally:
    orbax.close()


def test_latest_only_returns_newer_versions(meshes, tmp_path):
  generation = param_shardings(ARCH, meshes.generation, RULES)
  reshard = sync.ReshardSync(generation)
  assert reshard.latest() is None
  reshard.publish(_learner_params(meshes, 0), 4)
  assert reshard.latest(newer_than=4) is None
  assert reshard.latest(newer_than=3)[1] == 4
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))  # structure only
  orbax = sync.OrbaxSync(tmp_path / "w", generation, like=like)
  try:
    assert orbax.latest() is None
    orbax.publish(_learner_params(meshes, 0), 7)
    # A second reader (the generator job) sees what the writer published.
    reader = sync.OrbaxSync(tmp_path / "w", generation, like=like)
    params, version = reader.latest(newer_than=6)
    assert version == 7 and reader.latest(newer_than=7) is None
    reader.close()
  finally:
    orbax.close()



def test_an_asynchronous_writer_keeps_what_it_was_given(meshes, tmp_path):
  # A learner job writes each version in the background. What it published must not change
  # when its arrays are donated to the next step (deleted here) before the write finishes, and
  # a reader sees the newest version once the writer is done.
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))
  writer = sync.OrbaxSync(tmp_path / "w", generation, like=like, keep=2, asynchronous=True)
  try:
    published = {}
    for version in (1, 2, 3):
      params = _learner_params(meshes, version)
      published[version] = jax.device_get(params)
      writer.publish(params, version)
      for leaf in jax.tree.leaves(params):
        leaf.delete()
    writer.flush()  # the newest version is on storage: another job's reader sees it
    reader = sync.OrbaxSync(tmp_path / "w", generation, like=like)
    try:
      params, version = reader.latest(newer_than=0)
      assert version == 3
      chex.assert_trees_all_equal(jax.device_get(params), published[3])
      assert writer.versions() == [2, 3]
    finally:
      reader.close()
  finally:
    writer.close()


def test_a_resumed_writer_discards_the_versions_it_writes_again(meshes, tmp_path):
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))
  orbax = sync.OrbaxSync(tmp_path / "w", generation, like=like, keep=5)
  try:
    for version in (1, 2, 3):
      orbax.publish(_learner_params(meshes, version), version)
    assert orbax.discard_from(2) == 2 and orbax.versions() == [1]
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "w.discarded").iterdir()) == ["2", "3"]
    fresh = _learner_params(meshes, 20)
    orbax.publish(fresh, 2)  # written again, not declined as "not newer"
    params, version = orbax.latest(newer_than=1)
    assert version == 2
    chex.assert_trees_all_equal(jax.device_get(params), jax.device_get(fresh))
  finally:
    orbax.close()
  reshard = sync.ReshardSync(generation)
  reshard.publish(_learner_params(meshes, 0), 4)
  assert reshard.discard_from(5) == 0 and reshard.discard_from(4) == 1 and reshard.latest() is None


def test_a_reader_opened_while_the_writer_moves_a_version_aside(meshes, tmp_path, monkeypatch):
  """The generator job opens the versions while a resumed learner moves the dead run's newest
  away: the listing saw them, reading their metadata finds them gone. The reader lists again."""
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))
  writer = sync.OrbaxSync(tmp_path / "w", generation, like=like, keep=5)
  for version in (1, 2, 3):
    writer.publish(_learner_params(meshes, version), version)
  writer.close()
  load = sync.ocp.CheckpointManager._load_checkpoint_infos
  moved = []

  def racing_load(self, *args, **kwargs):
    if len(moved) < 2:  # one version vanishes between the listing and its metadata, twice
      step = 3 - len(moved)
      (tmp_path / "w" / str(step)).rename(tmp_path / f"aside-{step}")
      moved.append(step)
      raise FileNotFoundError(tmp_path / "w" / str(step) / "_CHECKPOINT_METADATA")
    return load(self, *args, **kwargs)

  monkeypatch.setattr(sync.ocp.CheckpointManager, "_load_checkpoint_infos", racing_load)
  reader = sync.OrbaxSync(tmp_path / "w", generation, like=like)
  try:
    assert moved == [3, 2] and reader.versions() == [1]
    assert reader.latest(newer_than=-1)[1] == 1
  finally:
    reader.close()


def test_a_version_moved_aside_between_the_listing_and_the_read_is_not_read(meshes, tmp_path,
                                                                            monkeypatch):
  """A restarted generator job lists version 3, then the resumed learner moves it aside (the
  dead run wrote it after its checkpoint) before the generator reads it: the generator lists
  again and reads version 2 (Orbax's own error for the vanished step said "Must provide `args`
  of type `Composite`", and the job died)."""
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))
  writer = sync.OrbaxSync(tmp_path / "w", generation, like=like, keep=5)
  for version in (1, 2, 3):
    writer.publish(_learner_params(meshes, version), version)
  reader = sync.OrbaxSync(tmp_path / "w", generation, like=like)
  listed = sync.ocp.CheckpointManager.latest_step
  raced = []

  def racing_latest(self):
    step = listed(self)
    if not raced:  # the learner moves the listed version aside before the reader reads it
      raced.append(step)
      writer.discard_from(step)
    return step

  monkeypatch.setattr(sync.ocp.CheckpointManager, "latest_step", racing_latest)
  try:
    params, version = reader.latest()
    assert raced == [3] and version == 2
    chex.assert_trees_all_equal(jax.device_get(params),
                                jax.device_get(_learner_params(meshes, 2)))
  finally:
    reader.close()
    writer.close()


def test_a_sync_keeps_each_version_in_the_form_the_generator_decodes_from(meshes, tmp_path):
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))
  per_layer = lambda params: dict(params, layers=[params["layers"]])  # noqa: E731 - a marker
  reshard = sync.ReshardSync(generation, prepare=per_layer)
  orbax = sync.OrbaxSync(tmp_path / "w", generation, like=like, prepare=per_layer)
  try:
    params = _learner_params(meshes, 1)
    reshard.publish(params, 1)
    orbax.publish(params, 1)
    for got in (reshard.latest()[0], orbax.latest()[0]):
      assert isinstance(got["layers"], list)
      chex.assert_trees_all_equal(jax.device_get(got["layers"][0]),
                                  jax.device_get(params["layers"]))
  finally:
    orbax.close()


def test_a_version_lands_in_the_generation_layout_and_the_learner_keeps_its_own(meshes):
  """The generator gets the same values, in the same shardings, as resharding then preparing
  gives; ``prepare`` is handed the sync's own copy, never the learner's arrays."""
  generation = param_shardings(ARCH, meshes.generation, RULES)
  handed = []

  def per_layer(params):  # a copy per layer, as the engine's decode_params makes
    handed.append(params)
    return dict(params, layers=[jax.tree.map(lambda w, i=i: w[i] + 0, params["layers"])
                                for i in range(ARCH.num_layers)])

  reshard = sync.ReshardSync(generation, prepare=per_layer)
  first, second = _learner_params(meshes, 1), _learner_params(meshes, 2)
  reshard.publish(first, 1)
  reshard.publish(second, 2)
  got = reshard.latest()[0]
  expected = per_layer(jax.device_put(second, generation))
  chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(expected))
  assert (jax.tree.map(lambda x: x.sharding, got)
          == jax.tree.map(lambda x: x.sharding, expected))
  learner_arrays = {id(x) for x in jax.tree.leaves((first, second))}
  assert not any(id(x) in learner_arrays for x in jax.tree.leaves(handed[0]))
  assert not any(x.is_deleted() for x in jax.tree.leaves(second))  # the learner's own stay
