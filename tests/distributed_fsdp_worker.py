"""One process of tests/test_distributed.py: the built-in model at its default size, FSDP over
2 processes with one CPU device each, trained by the supervised warm-up's step (its
gradients are reduce-scattered and its params all-gathered over gloo)."""

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 1)

from rlx import distributed  # noqa: E402

os.environ.update(JAX_COORDINATOR_ADDRESS=sys.argv[1], JAX_NUM_PROCESSES="2",
                  JAX_PROCESS_ID=sys.argv[2])
distributed.initialize(timeout_s=60, heartbeat_timeout_s=10, shutdown_timeout_s=10)

import numpy as np  # noqa: E402

from rlx import cli  # noqa: E402
from rlx.config import MeshConfig  # noqa: E402
from rlx.data import TaskSource, PromptStream  # noqa: E402
from rlx.mesh import make_meshes  # noqa: E402
from rlx.models import build_model, builtin_tokenizer  # noqa: E402
from rlx.trainer.setup.warmup import warm_up  # noqa: E402

config = cli.load_config_file("configs/dapo_split.py")
meshes = make_meshes(MeshConfig(mode="colocated", fsdp=-1))
model = build_model(config.model, meshes.learning, config.mesh.logical_axis_rules)
tokenizer = builtin_tokenizer()
rows = PromptStream(TaskSource(config.data.source, seed=0), batch_size=32, seed=1,
                    encode=tokenizer.encode_prompt)
model, losses = warm_up(model, rows, tokenizer, steps=2, learning_rate=1e-3)
assert np.isfinite(losses).all(), losses
print(f"process {jax.process_index()}: fsdp warm-up ok {losses}", flush=True)
