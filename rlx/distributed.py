"""The multi-controller helpers: every process runs the same program on its own rows.

    batch = global_array(sharding, local_rows)   # host rows -> one global jax.Array
    if lead(): write_metrics(...)                # process 0 alone writes files

Host data enters jitted programs only as global arrays built here, each process
giving the rows its devices hold; NumPy that differs per process must never be
passed as if it were replicated. In one process these are plain placements.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding


def lead() -> bool:
  """Whether this is process 0: the one that writes config, metrics and exports."""
  return jax.process_index() == 0


def global_array(sharding: NamedSharding, local_data: np.ndarray) -> jax.Array:
  """One global array from this process's rows (its share of dimension 0, in process order);
  with one process, ``local_data`` is the whole array."""
  return jax.make_array_from_process_local_data(sharding, np.asarray(local_data))


def global_tree(sharding: NamedSharding, tree: Any) -> Any:
  """``global_array`` of every leaf of ``tree`` (``sharding`` shared by all leaves)."""
  return jax.tree.map(lambda x: global_array(sharding, x), tree)
