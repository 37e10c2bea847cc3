"""Meshes, logical-axis rules, and one model sharded over 8 fake CPU devices."""

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlx import mesh as mesh_lib
from rlx import models
from rlx.config import ArchConfig, ConfigError, MeshConfig
from tests.conftest import HF_FAMILIES

RULES = MeshConfig().logical_axis_rules


def test_make_mesh_fills_fsdp_and_refuses_bad_sizes():
  assert jax.device_count() == 8
  mesh = mesh_lib.make_mesh(MeshConfig(tensor=2))
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  with pytest.raises(ConfigError, match="needs 12 devices"):
    mesh_lib.make_mesh(MeshConfig(data=3, fsdp=2, tensor=2))
  with pytest.raises(ConfigError, match="does not divide"):
    mesh_lib.make_mesh(MeshConfig(tensor=3))


def test_split_meshes_are_disjoint():
  meshes = mesh_lib.make_meshes(MeshConfig(mode="split", generation_devices=2, generation_tensor=2))
  assert not meshes.colocated
  generation, learning = set(meshes.generation.devices.flat), set(meshes.learning.devices.flat)
  assert len(generation) == 2 and len(learning) == 6 and not generation & learning
  assert dict(meshes.generation.shape) == {"data": 1, "fsdp": 1, "tensor": 2}
  assert mesh_lib.make_meshes(MeshConfig()).colocated
  with pytest.raises(ConfigError, match="leaves no device"):
    mesh_lib.make_meshes(MeshConfig(mode="split", generation_devices=8))


def test_logical_rules():
  mesh = mesh_lib.make_mesh(MeshConfig(fsdp=2, tensor=4))
  spec = lambda axes, shape: mesh_lib.logical_to_spec(axes, shape, mesh, RULES)
  assert spec(("layers", "embed", "heads", "head_dim"), (2, 64, 8, 16)) == P(None, "fsdp", "tensor", None)
  # 2 kv heads do not divide over tensor=4: replicated rather than an error.
  assert spec(("layers", "embed", "kv_heads", "head_dim"), (2, 64, 2, 16)) == P(None, "fsdp", None, None)
  assert spec(("batch", None), (8, 3)) == P(("data", "fsdp"), None)
  # A mesh axis is used once per array.
  assert spec(("vocab", "mlp"), (32, 32)) == P("tensor", None)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_sharded_model_gives_the_same_logits(hf_dir, family):
  data = np.load(hf_dir(family) / "expected.npz")
  tokens, mask = np.tile(data["tokens"], (4, 1)), np.tile(data["mask"], (4, 1))
  single = models.from_pretrained(hf_dir(family))
  mesh = mesh_lib.make_mesh(MeshConfig(fsdp=4, tensor=2))
  sharded = models.from_pretrained(hf_dir(family), mesh=mesh)
  q = sharded.params["layers"]["q"]
  assert q.sharding == NamedSharding(mesh, P(None, "fsdp", "tensor", None))
  assert len({s.device for s in q.addressable_shards}) == 8
  chex.assert_trees_all_equal(jax.device_get(sharded.params), jax.device_get(single.params))
  batch = NamedSharding(mesh, P(("data", "fsdp"), None))
  logits = sharded(jax.device_put(tokens, batch), jax.device_put(mask, batch))
  np.testing.assert_allclose(np.asarray(logits)[mask], np.asarray(single(tokens, mask))[mask],
                             atol=1e-5, rtol=1e-5)


def test_init_model_is_created_sharded():
  mesh = mesh_lib.make_mesh(MeshConfig(fsdp=2, tensor=4))
  model = models.init_model(ArchConfig(), jax.random.key(0), mesh=mesh)
  assert model.params["layers"]["gate"].sharding.spec == P(None, "fsdp", "tensor")
