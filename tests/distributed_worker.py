"""One process of tests/test_distributed.py: the multi-controller helpers across 2 processes
with 2 CPU devices each."""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)

from rlx import distributed  # noqa: E402

import os  # noqa: E402

os.environ.update(JAX_COORDINATOR_ADDRESS=sys.argv[1], JAX_NUM_PROCESSES="2",
                  JAX_PROCESS_ID=sys.argv[2])
distributed.initialize(timeout_s=60, heartbeat_timeout_s=10, shutdown_timeout_s=10)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from rlx import mesh as mesh_lib  # noqa: E402
from rlx.config import MeshConfig  # noqa: E402

me = jax.process_index()
assert distributed.lead() == (me == 0)
# process 0 decides, whatever the others hold
assert distributed.agree(f"version-{me}" * (3 - me)) == "version-0" * 3
assert distributed.agree(17 + me) == 17 and distributed.agree(me == 0) is True
np.testing.assert_array_equal(distributed.agree({"a": np.arange(3) + me})["a"], np.arange(3))
assert distributed.any_process(me == 1) and not distributed.any_process(False)
assert distributed.local_share(list(range(6)))[0] == [[0, 1, 2], [3, 4, 5]][me]
np.testing.assert_array_equal(distributed.sum_over_processes([me, 1.0]), [1, 2])
np.testing.assert_array_equal(distributed.max_over_processes([me, -me]), [1, 0])

# rows of each process -> one global array split over the 4 devices, and back whole
mesh = mesh_lib.make_mesh(MeshConfig(fsdp=-1))
rows = NamedSharding(mesh, P(("data", "fsdp")))
local = np.arange(4 * 3).reshape(4, 3) + 100 * me
array = distributed.global_array(rows, local)
assert array.shape == (8, 3) and not array.is_fully_addressable
whole = distributed.to_host({"rows": array, "sum": jax.jit(lambda x: x.sum(),
                                                         out_shardings=NamedSharding(mesh, P()))(array)})
np.testing.assert_array_equal(whole["rows"], np.concatenate([np.arange(12).reshape(4, 3),
                                                              np.arange(12).reshape(4, 3) + 100]))
assert int(whole["sum"]) == 2 * 66 + 1200

# a whole copy on this process's devices, without the other process's
replica = distributed.local_replica({"w": array})["w"]
assert replica.is_fully_addressable and set(replica.sharding.device_set) == set(jax.local_devices())
np.testing.assert_array_equal(np.asarray(replica), whole["rows"])

distributed.check_same({"step": np.int32(3)}, "the step")
try:
  distributed.check_same({"step": np.int32(3 + me)}, "the step")
except AssertionError as error:
  assert "the step differs between processes" in str(error), error
else:
  raise SystemExit("check_same let a divergent value through")
print(f"process {me}: distributed ok", flush=True)
