"""Device meshes and the map from logical parameter axes to mesh axes.

The learning mesh has three axes, ``("data", "fsdp", "tensor")``. Model
parameters name their dimensions with logical axes (``embed``, ``heads``,
``kv_heads``, ``mlp``, ``vocab``, ...); ``MeshConfig.logical_axis_rules`` maps
each logical axis to a mesh axis, so one model shards over any mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rlx.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")
# Logical rules may name this pseudo-axis to mean data and fsdp together (the batch).
DATA_FSDP = "data_fsdp"


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all).

  ``fsdp=-1`` takes whatever ``data * tensor`` leaves. Raises ``ConfigError``
  when the sizes do not multiply to the device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  fsdp = config.fsdp
  if fsdp == -1:
    if len(devices) % (config.data * config.tensor):
      raise ConfigError(
          f"config.mesh: data={config.data} x tensor={config.tensor} does not divide the "
          f"{len(devices)} devices; choose sizes whose product divides {len(devices)}")
    fsdp = len(devices) // (config.data * config.tensor)
  shape = (config.data, fsdp, config.tensor)
  if int(np.prod(shape)) != len(devices):
    raise ConfigError(
        f"config.mesh: data x fsdp x tensor = {shape} needs {int(np.prod(shape))} devices, "
        f"but {len(devices)} are available; set config.mesh.fsdp=-1 to fill the rest")
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


@dataclasses.dataclass(frozen=True)
class Meshes:
  """Where generation and learning run: the same devices (colocated) or disjoint ones (split)."""

  generation: Mesh
  learning: Mesh

  @property
  def colocated(self) -> bool:
    """Generation runs on learning devices (all of them, or one process's share)."""
    return set(self.generation.devices.flat) <= set(self.learning.devices.flat)


def make_meshes(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Meshes:
  """The generation and learning meshes of a deployment.

  Colocated: learning spans every device as ``(data, fsdp, tensor)``, generation
  as ``(rest, 1, generation_tensor)`` over every device of one process (with several
  processes, each generates on its own devices). Split: the first
  ``generation_devices`` devices (default half) generate, the rest learn.
  """
  devices = list(jax.devices() if devices is None else devices)
  if config.mode == "colocated":
    generation_devices, learning_devices = devices, devices
    if jax.process_count() > 1:  # each process generates on its own devices
      generation_devices = [d for d in devices if d.process_index == jax.process_index()]
  else:
    if len(devices) < 2:
      raise ConfigError(
          f"config.mesh.mode='split' needs at least 2 devices, found {len(devices)}; "
          "use config.mesh.mode=colocated, or more devices (config.mesh.cpu_devices on CPU)")
    count = config.generation_devices or len(devices) // 2
    if count >= len(devices):
      raise ConfigError(
          f"config.mesh.generation_devices={count} leaves no device to learn on "
          f"({len(devices)} devices); choose fewer than {len(devices)}")
    generation_devices, learning_devices = devices[:count], devices[count:]
  if len(generation_devices) % config.generation_tensor:
    raise ConfigError(
        f"config.mesh.generation_tensor={config.generation_tensor} does not divide the "
        f"{len(generation_devices)} generation devices")
  generation_config = dataclasses.replace(
      config, data=len(generation_devices) // config.generation_tensor, fsdp=1,
      tensor=config.generation_tensor)
  return Meshes(generation=make_mesh(generation_config, generation_devices),
                learning=make_mesh(config, learning_devices))


def single_device_mesh(device: jax.Device | None = None) -> Mesh:
  """A 1x1x1 mesh, for code that always expects one."""
  device = jax.devices()[0] if device is None else device
  return jax.make_mesh((1, 1, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=[device])


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Sequence[tuple[str, str | None]]) -> PartitionSpec:
  """The ``PartitionSpec`` of one array from its logical axis names.

  A dimension stays replicated when its logical axis has no rule, when the mesh
  axis is already used by an earlier dimension, or when the dimension does not
  divide evenly over the mesh axis (e.g. 2 kv heads on tensor=4).
  """
  if len(logical_axes) != len(shape):
    raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
  rule_map: Mapping[str, str | None] = dict(rules)
  used, spec = set(), []
  for name, size in zip(logical_axes, shape):
    target = rule_map.get(name) if name is not None else None
    mesh_axes = (("data", "fsdp") if target == DATA_FSDP else (target,)) if target else ()
    mesh_axes = tuple(a for a in mesh_axes if a in mesh.shape and a not in used)
    extent = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
    if not mesh_axes or extent == 1 or size % extent:
      spec.append(None)
      continue
    used.update(mesh_axes)
    spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return PartitionSpec(*spec)


def logical_shardings(logical_axes, shapes, mesh: Mesh, rules):
  """Maps trees of logical axes and shapes to a tree of ``NamedSharding``."""
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
  return jax.tree.map(
      lambda axes, shape: NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules)),
      logical_axes, shapes, is_leaf=is_axes)
