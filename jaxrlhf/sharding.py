"""Device meshes and the logical-axis sharding plan.

Parameters and activations carry logical axis names (batch, length, embed,
mlp, heads, kv, joined_kv, vocab, layers, relpos_buckets). A rule table from
the config maps each logical name to a mesh axis, a tuple of mesh axes, or
None (replicated), as in t5x and MaxText; the tables a config names are in
`jaxrlhf.sharding_rules`. Changing the plan is a config change; no model
code changes.

Mixture-of-experts weights have an `expert` axis, whole under the standard
rules; `experts_over` splits it over mesh axes (expert parallelism).
"""

import contextlib
import math
from typing import Any, Iterator, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def experts_over(rules, mesh_axes) -> Tuple[Tuple[str, Any], ...]:
  """`rules` with the mixture-of-experts weights' `expert` axis split over
  `mesh_axes` (a mesh axis name or a tuple of them): expert parallelism.

  The expert rule goes first, so that it takes its mesh axes before an
  `embed` or `mlp` rule would on the same weight (a mesh axis splits one
  dimension of an array). Each device then holds num_experts / D experts
  and `MoeMlp` computes only theirs (`jaxrlhf.models.layers.moe`). In a
  config: c.sharding.logical_axis_rules = sharding.experts_over(
  sharding_rules.STANDARD_RULES, "data").
  """
  if isinstance(mesh_axes, list):
    mesh_axes = tuple(mesh_axes)
  return (("expert", mesh_axes),) + tuple(
      rule for rule in as_rules(rules) if rule[0] != "expert")


def as_rules(rules) -> Tuple[Tuple[str, Any], ...]:
  """Normalises a config's rule list (lists from JSON/CLI) to tuples."""
  out = []
  for rule in rules:
    if len(rule) != 2:
      raise ValueError(f"sharding.logical_axis_rules: {rule!r} is not a "
                       "(logical_name, mesh_axes) pair.")
    name, axes = rule
    if isinstance(axes, list):
      axes = tuple(axes)
    out.append((name, axes))
  return tuple(out)


def create_mesh(shape: Sequence[int], axis_names: Sequence[str],
                devices=None) -> Mesh:
  """A mesh over all (or the given) devices; one entry of `shape` may be -1.

  Raises ValueError naming `mesh.shape` when it does not fit the devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = list(shape)
  if len(shape) != len(axis_names):
    raise ValueError(f"mesh.shape {tuple(shape)} and mesh.axis_names "
                     f"{tuple(axis_names)} differ in length.")
  if shape.count(-1) > 1:
    raise ValueError(f"mesh.shape {tuple(shape)}: at most one axis may be -1.")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(
          f"mesh.shape {tuple(shape)}: {len(devices)} devices are not "
          f"divisible by the fixed axes' product {known}.")
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ValueError(
        f"mesh.shape {tuple(shape)} needs {math.prod(shape)} devices but "
        f"{len(devices)} are available; set mesh.shape to fit (use -1 for "
        "'the rest').")
  # Auto axes: the compiler propagates shardings from our logical-axis
  # constraints (explicit-mode sharding-in-types is not what t5x rules model).
  return jax.make_mesh(tuple(shape), tuple(axis_names),
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                       devices=devices)


def _sampler_device_count(config) -> int:
  online = config.get("online")
  return online.sampler_devices if online is not None else 0


def split_devices(config, devices=None):
  """(training devices, sampler devices) of a run over all (or the given)
  devices: `online.sampler_devices` of them sample (each process gives an
  equal share, its first local devices, so that it samples rows it
  scores) and the rest train; no sampler devices when it is 0."""
  devices = list(jax.devices() if devices is None else devices)
  wanted = _sampler_device_count(config)
  if not wanted:
    return devices, []
  processes = sorted({d.process_index for d in devices})
  if wanted % len(processes) or wanted >= len(devices):
    raise ValueError(
        f"config.online.sampler_devices: {wanted} sampler devices out of "
        f"{len(devices)} on {len(processes)} process(es) must leave devices "
        "to train on and split equally over the processes; use a multiple of "
        f"{len(processes)} below {len(devices)}.")
  per_process = wanted // len(processes)
  sampler = []
  for p in processes:
    sampler += [d for d in devices if d.process_index == p][:per_process]
  chosen = set(sampler)
  return [d for d in devices if d not in chosen], sampler


def training_mesh(config, devices=None) -> Mesh:
  """`config.mesh`'s mesh over the devices that train (all or the given
  ones, less `online.sampler_devices`); errors name `config.mesh`."""
  try:
    return create_mesh(config.mesh.shape, config.mesh.axis_names,
                       split_devices(config, devices)[0])
  except ValueError as e:
    if str(e).startswith("config."):
      raise
    raise ValueError(f"config.{e}") from None


def sampler_mesh(config, devices=None):
  """The mesh of `online.sampler_devices` (`config.mesh`'s axes, its -1
  axis sized to fit them), or None when the run samples on the devices it
  trains on."""
  sampler = split_devices(config, devices)[1]
  if not sampler:
    return None
  try:
    return create_mesh(config.mesh.shape, config.mesh.axis_names, sampler)
  except ValueError as e:
    raise ValueError(f"config.online.sampler_devices: the sampler's "
                     f"{len(sampler)} devices do not fit config.{e}") from None


@contextlib.contextmanager
def activate(config, devices=None) -> Iterator[Mesh]:
  """Makes `config.mesh`'s mesh (over all or the given devices, less the
  sampler's: `training_mesh`) and `config.sharding`'s logical-axis rules
  current; yields the mesh.

  Recipes, samplers and train steps built inside see both, which is how
  every run, script and test enters a config's mesh.
  """
  mesh = training_mesh(config, devices)
  with jax.set_mesh(mesh), nn.logical_axis_rules(
      as_rules(config.sharding.logical_axis_rules)):
    yield mesh


def logical_to_spec(logical_axes, rules) -> PartitionSpec:
  return nn.logical_to_mesh_axes(logical_axes, rules)


def logical_sharding(mesh: Mesh, rules, logical_axes) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical_axes, rules))


def tree_shardings(boxed_tree, mesh: Mesh, rules):
  """NamedShardings for a tree whose leaves may be LogicallyPartitioned.

  Leaves without logical names are replicated.
  """
  specs = nn.get_partition_spec(boxed_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules, ndim: int) -> NamedSharding:
  """Sharding of a [batch, ...] input array: batch split, the rest whole."""
  return logical_sharding(mesh, rules, ("batch",) + (None,) * (ndim - 1))


def data_parallel_size(mesh: Mesh, rules) -> int:
  """How many ways the batch dimension is split."""
  spec = logical_to_spec(("batch",), rules)[0]
  if spec is None:
    return 1
  axes = spec if isinstance(spec, tuple) else (spec,)
  return math.prod(mesh.shape[a] for a in axes)


def spread_over_batch_axes(abstract_tree, shardings, mesh: Mesh, rules):
  """Shardings of `abstract_tree` that also split each array over the mesh
  axes the batch is split over (when the array does not use them yet):
  along its largest dimension that is not split and that divides evenly.

  What a gradient accumulator takes (`update.accumulate_gradients`): the
  sum of micro-batch gradients is then held once over the data-parallel
  devices, not once on each (a parameter's gradient is the same on every
  data shard after the reduction).
  """
  spec = logical_to_spec(("batch",), rules)[0]
  if spec is None:
    return shardings
  axes = spec if isinstance(spec, tuple) else (spec,)
  ways = math.prod(mesh.shape[a] for a in axes)

  def spread(leaf, named):
    dims = list(named.spec) + [None] * (leaf.ndim - len(named.spec))
    used = {a for d in dims if d is not None
            for a in (d if isinstance(d, tuple) else (d,))}
    if ways == 1 or used & set(axes):
      return named
    free = [d for d in range(leaf.ndim)
            if dims[d] is None and leaf.shape[d] % ways == 0]
    if not free:
      return named
    largest = max(free, key=lambda d: leaf.shape[d])
    dims[largest] = spec
    return NamedSharding(named.mesh, PartitionSpec(*dims))

  return jax.tree.map(spread, abstract_tree, shardings)


def global_batch(local_batch, mesh: Mesh, rules):
  """Joins each process's share of a batch into global jax.Arrays.

  Args:
    local_batch: dict of numpy arrays [local_batch, ...]; process p holds rows
      [p * local_batch, (p + 1) * local_batch) of the global batch.
  Returns:
    dict of jax.Arrays [global_batch, ...] sharded over the batch axes.
  """
  return {
      k: jax.make_array_from_process_local_data(
          batch_sharding(mesh, rules, np.ndim(v)), np.asarray(v))
      for k, v in local_batch.items()
  }
