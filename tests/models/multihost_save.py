"""One process of tests/models/test_multihost_checkpoint.py: load sharded over every
process's devices, save, and (process 0) compare with the source checkpoint."""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))

import numpy as np  # noqa: E402

from rlx import mesh as mesh_lib  # noqa: E402
from rlx import models  # noqa: E402
from rlx.config import MeshConfig  # noqa: E402
from rlx.models.safetensors_io import SafetensorsReader  # noqa: E402

source, target = sys.argv[3], sys.argv[4]
mesh = mesh_lib.make_mesh(MeshConfig(fsdp=2, tensor=2))
model = models.from_pretrained(source, mesh=mesh)
assert not model.params["layers"]["gate"].is_fully_addressable
models.save_pretrained(model, target, max_shard_bytes=200_000)
if jax.process_index() == 0:
  theirs, ours = SafetensorsReader(source), SafetensorsReader(target)
  assert ours.names() == theirs.names()
  for name in theirs.names():
    np.testing.assert_array_equal(ours.get(name), theirs.get(name), err_msg=name)
  print("multihost save ok")
