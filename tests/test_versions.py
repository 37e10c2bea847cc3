"""Policy versions between jobs as whole or delta files (``rlx.versions``): a reader that
follows, one that joins late and one after a resume rebuild every version bit for bit; deltas
are small where an update moves few bits; what a reader cannot rebuild or check stops it with
one line; the writer keeps what readers may still need and no more."""

import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import digest, sync
from rlx.models import param_shardings
from rlx.models.transformer import init_params
from rlx.versions import DeltaSync
from tests.test_sync import ARCH, RULES, meshes  # noqa: F401 - meshes: the shared fixture
from tests.test_sync import _learner_params


def _bf16_versions(meshes, count: int, seed: int = 0):
  """``count`` successive bfloat16 versions, each an RL-sized step (1e-3 relative) from the
  last: most elements do not move at bfloat16's precision."""
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _learner_params(meshes, seed))
  key = jax.random.key(seed)
  versions = []
  for _ in range(count):
    key, step = jax.random.split(key)
    leaves, tree = jax.tree.flatten(params)
    noise = [jax.random.normal(k, x.shape) for k, x in zip(jax.random.split(step, len(leaves)),
                                                            leaves)]
    params = jax.tree.unflatten(tree, [(x.astype(jnp.float32) * (1 + 1e-3 * n)).astype(x.dtype)
                                       for x, n in zip(leaves, noise)])
    versions.append(params)
  return versions


def _sync(meshes, path, **kw):
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
                      jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0))))
  return DeltaSync(path, generation, like=like, **kw)


def _bases(path) -> dict[int, int | None]:
  return {int(p.name): json.loads((p / "index.json").read_text())["base"]
          for p in path.iterdir() if p.name.isdigit()}


def test_followers_late_joiners_and_resumes_rebuild_every_version(meshes, tmp_path):
  versions = _bf16_versions(meshes, 7)
  writer = _sync(meshes, tmp_path / "v", keep=3, whole_every=3)
  follower = _sync(meshes, tmp_path / "v", keep=3, whole_every=3)
  try:
    for number, params in enumerate(versions[:5], start=1):
      writer.publish(params, number)
      writer.flush()
      got, version = follower.latest(newer_than=number - 1)
      assert version == number
      chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(params))
    # whole every third version, deltas between, each from the version before it
    assert _bases(tmp_path / "v") == {1: None, 2: 1, 3: 2, 4: None, 5: 4}
    whole = json.loads((tmp_path / "v" / "4" / "index.json").read_text())["arrays"]
    delta = json.loads((tmp_path / "v" / "5" / "index.json").read_text())["arrays"]
    assert sum(e["bytes"] for e in delta.values()) < 0.5 * sum(e["bytes"] for e in whole.values())
    assert follower.verified == 5 and follower.last_chain == [5]  # one delta a version
    # a reader that joins late: the newest whole version and the deltas after it
    late = _sync(meshes, tmp_path / "v")
    got, version = late.latest()
    assert version == 5 and late.last_chain == [4, 5]
    chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(versions[4]))
    # a resumed learner writes 4 again (whole: it no longer holds 3's bits), and 5 after it
    assert writer.discard_from(4) == 2 and writer.versions() == [1, 2, 3]
    for number in (4, 5):
      writer.publish(versions[number + 1], number)
    writer.flush()
    assert _bases(tmp_path / "v")[4] is None and _bases(tmp_path / "v")[5] == 4
    got, version = follower.latest(newer_than=3)
    assert version == 5
    chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(versions[6]))
  finally:
    writer.close()


def test_weights_read_on_one_device_need_no_copy_and_stay_their_version(meshes, tmp_path):
  """On one CPU device the generator's weights are the very buffers a version was read into
  (no copy); the next version, a delta from it, is built into new ones, so the weights a
  generator still samples with keep their version's values."""
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  versions = [jax.device_put(v, one) for v in _bf16_versions(meshes, 2)]
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), versions[0])
  place = jax.tree.map(lambda _: one, like)
  writer = DeltaSync(tmp_path / "v", place, like=like)
  reader = DeltaSync(tmp_path / "v", place, like=like)
  try:
    writer.publish(versions[0], 1)
    writer.flush()
    first, _ = reader.latest()
    held = {id(b.base if b.base is not None else b) for b in reader._held[1].values()}
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(first)]
    assert pointers == [b.ctypes.data for b in reader._held[1].values()]  # aliased, no copy
    snapshot = jax.tree.map(lambda x: np.array(x, copy=True), first)
    writer.publish(versions[1], 2)
    writer.flush()
    second, version = reader.latest(newer_than=1)
    assert version == 2 and _bases(tmp_path / "v")[2] == 1
    assert held.isdisjoint(id(b.base if b.base is not None else b)
                           for b in reader._held[1].values())
    chex.assert_trees_all_equal(jax.device_get(first), snapshot)
    chex.assert_trees_all_equal(jax.device_get(second), jax.device_get(versions[1]))
  finally:
    writer.close()


def test_the_writer_keeps_what_a_reader_may_still_need(meshes, tmp_path):
  writer = _sync(meshes, tmp_path / "v", keep=2, whole_every=3)
  try:
    for number, params in enumerate(_bf16_versions(meshes, 8), start=1):
      writer.publish(params, number)
    writer.flush()
    # the newest 2 (7, 8) and the chain back to their whole version (7 is whole: 1, 4, 7)
    assert writer.versions() == [7, 8]
  finally:
    writer.close()


def test_what_a_reader_cannot_rebuild_or_check_stops_it_with_one_line(meshes, tmp_path,
                                                                        monkeypatch):
  versions = _bf16_versions(meshes, 4)
  writer = _sync(meshes, tmp_path / "v", keep=5, whole_every=10)
  reader = _sync(meshes, tmp_path / "v")
  try:
    writer.publish(versions[0], 1)
    writer.flush()
    assert reader.latest()[1] == 1
    # a delta's data cut short
    writer.publish(versions[1], 2)
    writer.flush()
    data = tmp_path / "v" / "2" / "data"
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
    with pytest.raises(sync.SyncMismatch, match=r"policy version 2 could not be read .*cut short"):
      reader.latest(newer_than=1)
    # a whole version whose bits were changed on storage: its digest sees it
    other = _sync(meshes, tmp_path / "w")
    other.publish(versions[0], 1)
    other.flush()
    raw = np.fromfile(tmp_path / "w" / "1" / "data", np.uint8)
    raw[100] ^= 0x40
    raw.tofile(tmp_path / "w" / "1" / "data")
    with pytest.raises(sync.SyncMismatch, match=r"policy version 1 did not land .*read from"):
      _sync(meshes, tmp_path / "w").latest()
    other.close()
    # a chain with a link removed and no whole version to start from
    lost = _sync(meshes, tmp_path / "x", keep=5)
    for number in (1, 2, 3):
      lost.publish(versions[number - 1], number)
    lost.flush()
    follower = _sync(meshes, tmp_path / "x")
    shutil.rmtree(tmp_path / "x" / "1")
    monkeypatch.setattr("rlx.versions.time.sleep", lambda s: None)
    with pytest.raises(sync.SyncMismatch, match=r"no readable chain of versions up to 3"):
      follower.latest()
    lost.close()
  finally:
    writer.close()


def test_a_no_op_version_is_refused_at_the_next_publish(meshes, tmp_path):
  writer = _sync(meshes, tmp_path / "v")
  params = _bf16_versions(meshes, 1)[0]
  try:
    writer.publish(params, 1)
    writer.publish(jax.tree.map(jnp.copy, params), 2, changed=True)  # bitwise version 1
    with pytest.raises(sync.SyncMismatch, match="version 2 is bitwise version 1 although"):
      writer.flush()
  finally:
    writer._pending = None
    writer.close()


def test_float32_versions_round_trip_and_their_digest_matches(meshes, tmp_path):
  generation = param_shardings(ARCH, meshes.generation, RULES)
  like = jax.eval_shape(lambda: init_params(ARCH, jax.random.key(0)))
  writer = DeltaSync(tmp_path / "v", generation, like=like)
  reader = DeltaSync(tmp_path / "v", generation, like=like)
  try:
    for number in (1, 2):
      params = _learner_params(meshes, number)
      writer.publish(params, number)
      writer.flush()
      got, version = reader.latest(newer_than=number - 1)
      assert version == number and digest.tree_digest(got) == digest.tree_digest(params)
  finally:
    writer.close()


def test_a_failed_write_stops_every_process_at_the_next_publish(meshes, tmp_path, monkeypatch):
  """The lead process alone writes versions; its failure is agreed at the next publish, so the
  other processes stop there too, instead of waiting at a collective for XLA's timeout."""
  from rlx import versions
  writer = _sync(meshes, tmp_path / "v")
  params = _bf16_versions(meshes, 1)[0]
  told = []
  monkeypatch.setattr(versions.distributed, "any_process",
                      lambda flag: told.append(flag) or True)  # another process's write failed
  try:
    monkeypatch.setattr(versions.distributed, "lead", lambda: False)  # this one writes nothing
    with pytest.raises(sync.SyncMismatch, match="failed on the lead process"):
      writer.publish(params, 1)
    assert told == [False]
  finally:
    writer.close()
