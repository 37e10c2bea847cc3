"""Every policy version is checked where it lands: the digest (exact whatever the layout,
sharding or form) and the faults a sync must not let through, each stopping with one line
naming the version and the array: an array left at its old value, two arrays swapped, a
version's files from another version, a generator that keeps its first weights, a version
bitwise the last one, a LoRA generator merging at another scale."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import digest
from rlx import sync
from rlx.models import param_shardings
from rlx.models.transformer import init_params, unstack_layers
from tests.test_sync import ARCH, RULES, meshes  # noqa: F401 - meshes: the shared fixture
from tests.test_sync import _learner_params as _params


def test_the_digest_is_exact_whatever_the_layout_and_sees_every_change(meshes):
  params = _params(meshes, 0)
  taken = digest.tree_digest(params)
  host = jax.device_get(params)
  assert digest.tree_digest(host) == taken  # sharded over the learning mesh or on one device
  assert digest.tree_digest(unstack_layers(params)) == taken  # the generator's per-layer form
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), host)
  assert digest.tree_digest(unstack_layers(bf16)) == digest.tree_digest(bf16) != taken
  # one element one ulp off; two elements of an array swapped; two arrays swapped
  q = np.array(host["layers"]["q"])
  q.reshape(-1)[7] = np.nextafter(q.reshape(-1)[7], np.float32(1))
  assert digest.differences(taken, digest.tree_digest(
      dict(host, layers=dict(host["layers"], q=q)))) == ["layers/q"]
  q = np.array(host["layers"]["q"])
  flat = q.reshape(-1)
  flat[[3, 11]] = flat[[11, 3]]
  assert digest.differences(taken, digest.tree_digest(
      dict(host, layers=dict(host["layers"], q=q)))) == ["layers/q"]
  swapped = dict(host, layers=dict(host["layers"], gate=host["layers"]["up"],
                                   up=host["layers"]["gate"]))
  assert digest.differences(taken, digest.tree_digest(swapped)) == ["layers/gate", "layers/up"]
  # two elements of one row swapped (the columns' weights see it)
  q = np.array(host["layers"]["q"])
  q[0, 0, 0, [1, 2]] = q[0, 0, 0, [2, 1]]
  assert digest.differences(taken, digest.tree_digest(
      dict(host, layers=dict(host["layers"], q=q)))) == ["layers/q"]


def test_the_jitted_digest_equals_the_numpy_one(meshes):
  """The accelerators' program against the CPU's numpy over shards, on sharded, per-layer,
  bfloat16 and scalar arrays."""
  params = _params(meshes, 3)
  for tree in (params, unstack_layers(params), jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                            params),
               {"scalar": jnp.float32(1.5), "vector": jnp.arange(5.0)}):
    assert digest.jitted_tree_digest(tree) == digest.tree_digest(tree)


def test_reshard_checks_each_version_where_it_lands(meshes):
  generation = param_shardings(ARCH, meshes.generation, RULES)
  stale = {}

  def keeps_one_array(params):  # from version 3 on, "layers/down" of layer 1 is left behind
    landed = unstack_layers(params)
    if "down" in stale:
      landed["layers"][1]["down"] = stale["down"]
    stale.setdefault("down", landed["layers"][1]["down"])
    return landed

  reshard = sync.ReshardSync(generation, prepare=keeps_one_array)
  reshard.publish(_params(meshes, 1), 1)
  stale.clear()  # version 1 landed as published: nothing is kept until it lands
  assert reshard.latest()[1] == 1
  stale["down"] = reshard.latest()[0]["layers"][1]["down"]
  reshard.publish(_params(meshes, 3), 3)
  with pytest.raises(sync.SyncMismatch, match=r"policy version 3 .*layers/down .*1 of 11 arrays"):
    reshard.latest()
  assert reshard.verified == 1


def test_the_learner_s_part_is_the_digest_and_the_copy_s_start(meshes):
  """``publish`` leaves the landing to the generator's ``latest``: a version published twice
  before the generator looks lands once, the newer one; the learner may donate (delete) its
  params right after ``publish``."""
  generation = param_shardings(ARCH, meshes.generation, RULES)
  landings = []

  def counted(params):
    landings.append(1)
    return unstack_layers(params)

  reshard = sync.ReshardSync(generation, prepare=counted)
  first, second = _params(meshes, 1), _params(meshes, 2)
  want = digest.tree_digest(second)
  reshard.publish(first, 1)
  reshard.publish(second, 2)
  for x in jax.tree.leaves(second):  # what a donating update does to them
    x.delete()
  assert landings == []
  params, version = reshard.latest()
  assert version == 2 and landings == [1] and reshard.verified == 1
  assert digest.tree_digest(params) == want
  assert reshard.latest(newer_than=2) is None and landings == [1]


def test_two_swapped_arrays_and_a_generator_that_keeps_its_first_weights(meshes):
  generation = param_shardings(ARCH, meshes.generation, RULES)

  def swap(params):
    layers = dict(params["layers"], gate=params["layers"]["up"], up=params["layers"]["gate"])
    return dict(params, layers=layers)

  swapping = sync.ReshardSync(generation, prepare=swap)
  swapping.publish(_params(meshes, 1), 1)
  with pytest.raises(sync.SyncMismatch, match="layers/gate"):
    swapping.latest()
  first = {}

  def keeps_first(params):
    first.setdefault("params", params)
    return first["params"]

  stuck = sync.ReshardSync(generation, prepare=keeps_first)
  stuck.publish(_params(meshes, 1), 1)
  stuck.latest()
  stuck.publish(_params(meshes, 2), 2)
  with pytest.raises(sync.SyncMismatch, match="policy version 2"):
    stuck.latest()


def test_a_version_bitwise_the_last_one_is_refused(meshes):
  generation = param_shardings(ARCH, meshes.generation, RULES)
  reshard = sync.ReshardSync(generation)
  params = _params(meshes, 1)
  reshard.publish(params, 1)
  reshard.publish(params, 1, changed=True)  # the same version again is no new version
  # an update that moved nothing (all advantages 0) makes a version bitwise the last one
  reshard.publish(jax.tree.map(jnp.copy, params), 2, changed=False)
  with pytest.raises(sync.SyncMismatch, match="version 3 is bitwise version 2 although"):
    reshard.publish(jax.tree.map(jnp.copy, params), 3, changed=True)


def test_orbax_refuses_a_version_whose_files_are_another_version_s(meshes, tmp_path):
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))
  writer = sync.OrbaxSync(tmp_path / "weights", generation, like=like, keep=3)
  reader = sync.OrbaxSync(tmp_path / "weights", generation, like=like, keep=3,
                          prepare=unstack_layers)
  try:
    for version in (1, 2):
      writer.publish(_params(meshes, version), version)
    assert reader.latest()[1] == 2 and reader.verified == 1
    # version 3's directory holds version 1's files
    writer.publish(_params(meshes, 3), 3)
    shutil.rmtree(tmp_path / "weights" / "3")
    shutil.copytree(tmp_path / "weights" / "1", tmp_path / "weights" / "3")
    with pytest.raises(sync.SyncMismatch, match=r"policy version 3 did not land .*read from"):
      reader.latest(newer_than=2)
    # a version written without a digest (an older run's) is read unchecked
    (tmp_path / "weights.digests" / "3.json").unlink()
    assert reader.latest(newer_than=2)[1] == 3 and reader.verified == 1
  finally:
    writer.close()
    reader.close()


def test_a_lora_generator_refuses_another_merge_scale(meshes, tmp_path):
  from rlx.config import LoraConfig
  from rlx.models import lora
  generation = param_shardings(ARCH, meshes.generation, RULES)
  config = LoraConfig(rank=4)
  adapters = lora.init_adapters(ARCH, config, jax.random.key(1))
  like = jax.eval_shape(lambda: adapters)
  replicated = jax.sharding.NamedSharding(meshes.generation, jax.sharding.PartitionSpec())
  shardings = jax.tree.map(lambda _: replicated, like)
  base = jax.device_put(init_params(ARCH, jax.random.key(0)), generation)
  reference = {"path": "base", "fingerprint": "abc"}
  make = lambda scale: sync.LoraSync(
      sync.OrbaxSync(tmp_path / "adapters", shardings, like=like), base, scale,
      reference=reference, reference_file=tmp_path / "reference.json")
  learner, generator = make(config.scale), make(config.scale / 2)
  try:
    learner.publish(adapters, 1)
    assert json.loads((tmp_path / "reference.json").read_text())["scale"] == config.scale
    with pytest.raises(sync.SyncMismatch, match="scaled by"):
      generator.latest()
    assert make(config.scale).latest()[1] == 1
  finally:
    learner.close()
    generator.close()


def test_orbax_refuses_a_truncated_version(meshes, tmp_path):
  """A write cut short (a full disk, a killed copy): the reader stops with one line naming
  the version, whatever the storage layer's own error, or its digest catches what it read."""
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))
  writer = sync.OrbaxSync(tmp_path / "weights", generation, like=like, keep=3)
  reader = sync.OrbaxSync(tmp_path / "weights", generation, like=like, keep=3)
  try:
    writer.publish(_params(meshes, 1), 1)
    files = sorted((p for p in (tmp_path / "weights" / "1").rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
    largest = files[-1]
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    with pytest.raises(sync.SyncMismatch, match=r"policy version 1 .*could not be read"):
      reader.latest()
  finally:
    writer.close()
    reader.close()
