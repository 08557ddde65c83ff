"""Orbax checkpoints of the whole training state.

A checkpoint holds the train state pytree (every network's parameters, every
optimizer state, the step and the RNG) and a small JSON item with the data
position. Orbax writes each step into a temporary directory and renames it
when complete, so a crash mid-write never leaves a step that `latest_step`
would pick up; older steps beyond `keep` are deleted only after a newer one
is complete.
"""

import logging
import os
from typing import Any, Optional, Tuple

from flax import serialization
import jax
import orbax.checkpoint as ocp

from jaxrlhf import checkpoint_files


class Checkpointer:
  """Saves and restores (state, data position) under `directory`."""

  def __init__(self, directory: str, keep: int):
    self._manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True,
            # Saves are synchronous: a save has finished (and is atomic) when
            # `save` returns, so a preempted run exits only after its save.
            enable_async_checkpointing=False,
            cleanup_tmp_directories=True))

  @property
  def directory(self):
    return self._manager.directory

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self):
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, data_position: int) -> None:
    self._manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave({"position": int(data_position)})),
        force=True)
    self._manager.wait_until_finished()
    logging.info("Saved checkpoint for step %d to %s", step, self.directory)

  def restore(self, step: int, abstract_state: Any) -> Tuple[Any, int]:
    """Restores into the shapes, dtypes and shardings of `abstract_state`.

    Args:
      abstract_state: a pytree of jax.ShapeDtypeStruct with `sharding` set,
        the same structure as the saved state.
    """
    self._check_parameter_shapes(step, abstract_state)
    try:
      restored = self._manager.restore(
          step,
          args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract_state),
              data=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(
          f"Checkpoint step {step} in {self.directory} does not match this "
          f"run's model or optimizer ({e}). Use a fresh --workdir, or the "
          "config the checkpoint was written with.") from e
    return restored["state"], int(restored["data"]["position"])

  def _check_parameter_shapes(self, step: int, abstract_state: Any) -> None:
    """A one-line error naming the parameters whose saved shapes differ
    from this run's (a changed model config), instead of the storage
    layer's failure partway through reading them."""
    try:
      saved = checkpoint_files.state_metadata(
          os.path.join(str(self.directory), str(step),
                       checkpoint_files.STATE_ITEM))
      saved = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in
               jax.tree_util.tree_flatten_with_path(saved)[0]
               if hasattr(v, "shape")}
    except Exception:  # pylint: disable=broad-except
      return  # no readable metadata: the restore itself will say what
    expected = serialization.to_state_dict(abstract_state)
    differ = []
    for group in ("params", "frozen"):
      for k, v in jax.tree_util.tree_flatten_with_path(
          expected.get(group, {}))[0]:
        key = f"['{group}']" + jax.tree_util.keystr(k)
        if key in saved and saved[key] != tuple(v.shape):
          differ.append(f"{key} is {saved[key]} there, {tuple(v.shape)} "
                        "here")
    if differ:
      raise ValueError(
          f"Checkpoint step {step} in {self.directory} was written for "
          f"another model: {'; '.join(differ[:3])}"
          f"{f' (and {len(differ) - 3} more)' if len(differ) > 3 else ''}. "
          "Resume with the config it was written with (config.json in the "
          "workdir), or use a fresh --workdir.")

  def close(self):
    self._manager.close()
