"""The on-disk layout of a jaxrlhf run, read without the run.

  <workdir>/config.json                 the resolved config of the run
  <workdir>/checkpoints/<step>/state/   the train state (an orbax PyTree item)
  <workdir>/checkpoints/<step>/data/    the data position (orbax JSON item)

`jaxrlhf.train.checkpointing` writes and restores these inside a run; this
module is what everything else uses to find and read them: loading a policy,
a reward model or a value network from another run, `from_pretrained`, and
the start-up checks.

The state item is read with orbax's PyTree handler directly: orbax's
`Checkpointer` expects a step directory and warns that the item directory
has no step metadata file, which it is not meant to have.
"""

import json
import os
import pathlib
from typing import Any, Optional

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

STATE_ITEM = "state"
DATA_ITEM = "data"
CHECKPOINTS = "checkpoints"
RUN_CONFIG = "config.json"


class NoCheckpointError(ValueError):
  """A path that holds no jaxrlhf checkpoint."""


def is_state_item(path) -> bool:
  path = pathlib.Path(path)
  return path.is_dir() and ((path / "_METADATA").is_file()
                            or (path / "manifest.ocdbt").is_file())


def checkpoint_steps(path) -> list:
  """The steps with a complete state item under a workdir or its
  `checkpoints/` directory, ascending."""
  path = pathlib.Path(path)
  if (path / CHECKPOINTS).is_dir():
    path = path / CHECKPOINTS
  if not path.is_dir():
    return []
  return sorted(int(d.name) for d in path.iterdir()
                if d.name.isdigit() and is_state_item(d / STATE_ITEM))


def state_item_dir(path, step: Optional[int] = None) -> pathlib.Path:
  """The state item of `path`: itself if it is one, `<path>/state`, or
  `<step>/state` (the latest step, or `step`) of a workdir or its
  `checkpoints/` directory."""
  path = pathlib.Path(path)
  if is_state_item(path):
    return path
  if is_state_item(path / STATE_ITEM):
    return path / STATE_ITEM
  steps = checkpoint_steps(path)
  if not steps:
    raise NoCheckpointError(
        f"{str(path)!r} holds no jaxrlhf checkpoint (expected a workdir with "
        f"{CHECKPOINTS}/<step>/{STATE_ITEM}, or one step of it).")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise NoCheckpointError(f"{str(path)!r} has no step {step}; it has "
                            f"{steps}.")
  base = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
  return base / str(step) / STATE_ITEM


def state_metadata(item_dir) -> Any:
  """The saved tree of a state item: a pytree of orbax array metadata
  (each with `.shape` and `.dtype`)."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    return handler.metadata(epath.Path(item_dir)).tree
  finally:
    handler.close()


def restore_state(item_dir, target=None, restore_args=None,
                  partial: bool = False) -> Any:
  """Restores a state item. `target` is a pytree of ShapeDtypeStructs (with
  shardings for jax.Arrays) and `restore_args` orbax's per-leaf arguments;
  `partial` restores only the subtrees `target` names."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    return handler.restore(epath.Path(item_dir), args=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=partial))
  finally:
    handler.close()


def restore_state_as_numpy(item_dir) -> Any:
  """The whole saved state as host numpy arrays, whatever mesh wrote it.

  Each process holds a full host copy (fine for the sizes of the networks a
  run reads from another run; large pretrained models come as T5X or
  safetensors checkpoints, which load shard by shard).
  """
  tree = state_metadata(item_dir)
  restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return restore_state(item_dir, restore_args=restore_args)


def run_config(path) -> Optional[dict]:
  """The config.json a jaxrlhf run wrote, found from its workdir, its
  `checkpoints/` directory, one step of it or the step's state item; None
  if there is none."""
  path = os.path.abspath(os.fspath(path))
  # Climb out of <workdir>/checkpoints/<step>/state, and no further: a
  # pipeline's own config.json sits one level above its stages.
  for name in (STATE_ITEM, None, CHECKPOINTS):
    base = os.path.basename(path)
    if base == name or (name is None and base.isdigit()):
      path = os.path.dirname(path)
  candidate = os.path.join(path, RUN_CONFIG)
  if not os.path.isfile(candidate):
    return None
  with open(candidate) as f:
    return json.load(f)
