"""Orbax checkpoints of the whole training state, verified before use.

A checkpoint holds the train state pytree (every network's parameters, every
optimizer state, the step, the RNG and the algorithm's carried scalars) and a
small JSON item with the data position. Orbax writes each step into a
temporary directory and renames it when complete. After that, process 0
writes `jaxrlhf_manifest.json` into the step: the size and SHA-256 of every
file of the step. The manifest is the commit mark: a step without one was
interrupted after orbax's rename (or comes from a version of jaxrlhf that
wrote none, when no step has one).

Before a step is restored its files are checked against its manifest. A step
that fails (a flipped byte, a truncated or missing file, no manifest) is
reported in one line naming the step and the file, moved into
`<workdir>/damaged_checkpoints/` (never deleted), and the previous step is
tried; if no step verifies, the run is refused and nothing is moved. Older
steps beyond `keep` are deleted only once a newer one has its manifest.

A save that cannot be written (a full disk, a quota) stops the run with one
line saying where and why; its temporary files are removed and the previous
checkpoint is kept.
"""

import errno
import hashlib
import json
import os
import time
from typing import Any, List, Optional, Tuple

from etils import epath
from flax import serialization
import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrlhf import checkpoint_files
from jaxrlhf import console

MANIFEST = "jaxrlhf_manifest.json"
DAMAGED = "damaged_checkpoints"
_FORMAT = 1
_CHUNK = 1 << 22


class CheckpointError(ValueError):
  """No checkpoint can be restored, or one cannot be used."""


class WriteError(RuntimeError):
  """A file of the run (checkpoint, metrics, config) could not be written."""


def write_failure(error: BaseException, what: str) -> Optional[WriteError]:
  """A one-line WriteError when `error` (or what caused it) is a failed
  write: a full disk, a quota, a file size limit, an I/O error; else None."""
  reasons = {errno.ENOSPC: "the disk is full (no space left on device)",
             errno.EDQUOT: "the disk quota is exceeded",
             errno.EFBIG: "a file would exceed the file size limit",
             errno.EIO: "an input/output error", errno.EROFS:
                 "the file system is read-only"}
  markers = {"No space left": errno.ENOSPC, "Disk quota": errno.EDQUOT,
             "File too large": errno.EFBIG, "Read-only file": errno.EROFS}
  seen, current = set(), error
  while current is not None and id(current) not in seen:
    seen.add(id(current))
    code = getattr(current, "errno", None)
    if code not in reasons:
      code = next((c for m, c in markers.items() if m in str(current)), None)
    if code in reasons:
      return WriteError(f"Could not write {what}: {reasons[code]}. Free space "
                        "(or raise the limit) and run the same command "
                        "again: it resumes from the last complete checkpoint.")
    current = current.__cause__ or current.__context__
  return None


def _sha256(path: epath.Path) -> Tuple[int, str]:
  digest, size = hashlib.sha256(), 0
  with path.open("rb") as f:
    while True:
      chunk = f.read(_CHUNK)
      if not chunk:
        break
      size += len(chunk)
      digest.update(chunk)
  return size, digest.hexdigest()


def _files(step_dir: epath.Path) -> List[str]:
  """The step's files (relative paths, sorted), the manifest left out."""
  out = []
  # walk, not rglob: gcsfs-backed paths refuse recursive glob patterns.
  for folder, _, names in step_dir.walk():
    for name in names:
      if name != MANIFEST:
        out.append(str((epath.Path(folder) / name).relative_to(step_dir)))
  return sorted(out)


def write_manifest(step_dir) -> None:
  """Writes the step's manifest atomically (a temporary file renamed)."""
  step_dir = epath.Path(step_dir)
  entries = {}
  for name in _files(step_dir):
    size, digest = _sha256(step_dir / name)
    entries[name] = {"size": size, "sha256": digest}
  tmp = step_dir / (MANIFEST + ".tmp")
  tmp.write_text(json.dumps({"format": _FORMAT, "files": entries}, indent=1,
                            sort_keys=True))
  tmp.rename(step_dir / MANIFEST)


def verify(step_dir) -> Optional[str]:
  """Why the step's files do not match its manifest, or None if they do."""
  step_dir = epath.Path(step_dir)
  manifest = step_dir / MANIFEST
  if not manifest.exists():
    return f"it has no {MANIFEST} (its save did not finish)"
  try:
    entries = json.loads(manifest.read_text())["files"]
  except (ValueError, KeyError, TypeError) as e:
    return f"its {MANIFEST} cannot be read ({e})"
  for name, expected in sorted(entries.items()):
    path = step_dir / name
    if not path.exists():
      return f"file {name} is missing"
    size, digest = _sha256(path)
    if size != expected["size"]:
      return (f"file {name} has {size} bytes, {expected['size']} when "
              "saved (truncated or overwritten)")
    if digest != expected["sha256"]:
      return f"file {name} does not have the contents it was saved with"
  return None


class Checkpointer:
  """Saves and restores (state, data position) under `directory`."""

  def __init__(self, directory: str, keep: int):
    self._keep = keep
    self._manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            # Pruning is ours: only after the newer step has its manifest.
            max_to_keep=None, create=True,
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
    return sorted(self._manager.all_steps())

  def _step_dir(self, step: int) -> epath.Path:
    return epath.Path(self.directory) / str(step)

  def save(self, step: int, state: Any, data_position: int) -> None:
    """Saves `step` atomically with its manifest, then prunes old steps.

    Raises:
      WriteError: the files could not be written (the previous checkpoints
        are kept, the temporary ones removed).
    """
    try:
      self._manager.save(
          step,
          args=ocp.args.Composite(
              state=ocp.args.StandardSave(state),
              data=ocp.args.JsonSave({"position": int(data_position)})),
          force=True)
      self._manager.wait_until_finished()
      if jax.process_index() == 0:
        write_manifest(self._step_dir(step))
      _barrier(f"checkpoint_manifest_{step}")
    except Exception as e:  # pylint: disable=broad-except
      failure = write_failure(e, f"the checkpoint of step {step} in "
                              f"{self.directory}")
      if failure is None:
        raise
      self._remove_unfinished(step)
      raise failure from None
    self._prune()

  def _remove_unfinished(self, step: int) -> None:
    """Removes what a failed save of `step` left: orbax's temporary
    directory, or the step without its manifest (moved aside)."""
    if jax.process_index() != 0:
      return
    root = epath.Path(self.directory)
    for path in root.glob(f"{step}.orbax-checkpoint-tmp*"):
      path.rmtree()
    step_dir = self._step_dir(step)
    if step_dir.exists():
      try:
        step_dir.rmtree()  # never complete, so nothing is lost
      except OSError:
        pass
    for tmp in root.glob(f"{step}/{MANIFEST}.tmp"):
      tmp.unlink()

  def _prune(self) -> None:
    steps = self.all_steps()
    for step in steps[:max(len(steps) - self._keep, 0)]:
      self._manager.delete(step)

  def restore_latest(self, abstract_state: Any
                     ) -> Optional[Tuple[int, Any, int]]:
    """(step, state, data position) of the newest step that verifies, or None
    when there is no checkpoint; damaged newer steps are moved aside.

    Raises:
      CheckpointError: there are checkpoints but none verifies (nothing is
        moved), or the newest verified one does not fit this run.
    """
    steps = self.all_steps()
    if not steps:
      return None
    step = self._choose_step(steps)
    state, position = self.restore(step, abstract_state)
    return step, state, position

  def _choose_step(self, steps: List[int]) -> int:
    """The newest step that verifies (decided on process 0, moved aside
    there, the same on every process)."""
    chosen, refusal = -1, None
    if jax.process_index() == 0:
      try:
        chosen = self._verified_step(steps)
      except CheckpointError as e:
        refusal = e
    chosen = _broadcast(chosen)  # -1: none verifies
    if chosen < 0:
      raise refusal or CheckpointError(
          f"No checkpoint in {self.directory} verifies (process 0 lists "
          "them); the run cannot resume.")
    if jax.process_count() > 1:
      _barrier("checkpoint_choice")
      self._manager.reload()
    return chosen

  def _verified_step(self, steps: List[int]) -> int:
    with_manifest = [s for s in steps
                     if (self._step_dir(s) / MANIFEST).exists()]
    if not with_manifest:
      # Written by a jaxrlhf that wrote no manifests: nothing to check.
      console.log(f"Checkpoints in {self.directory} have no manifest "
                  f"({MANIFEST}); restoring step {steps[-1]} unverified.")
      return steps[-1]
    problems = {}
    for step in reversed(steps):
      problem = verify(self._step_dir(step))
      if problem is None:
        break
      problems[step] = problem
    else:
      listed = "; ".join(f"step {s}: {p}" for s, p in sorted(problems.items()))
      raise CheckpointError(
          f"No checkpoint in {self.directory} verifies ({listed}), so the run "
          "cannot resume. Restore the files from a copy, or start over in a "
          "fresh --workdir.")
    for damaged, problem in sorted(problems.items()):
      target = self._move_aside(damaged)
      console.log(f"Checkpoint step {damaged} in {self.directory} is "
                  f"damaged: {problem}. Moved it to {target}; resuming from "
                  f"step {step}.")
    self._manager.reload()
    return step

  def _move_aside(self, step: int) -> epath.Path:
    root = epath.Path(self.directory).parent / DAMAGED
    root.mkdir(parents=True, exist_ok=True)
    target = root / str(step)
    if target.exists():
      target = root / f"{step}.{time.strftime('%Y%m%d-%H%M%S')}"
    self._step_dir(step).rename(target)
    return target

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
      raise CheckpointError(
          f"Checkpoint step {step} in {self.directory} could not be restored "
          f"into this run's state ({str(e).splitlines()[0]}): it was written "
          "by another model, optimizer or algorithm. Resume with the config "
          "it was written with (config.json in the workdir), or use a fresh "
          "--workdir.") from e
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
      raise CheckpointError(
          f"Checkpoint step {step} in {self.directory} was written for "
          f"another model: {'; '.join(differ[:3])}"
          f"{f' (and {len(differ) - 3} more)' if len(differ) > 3 else ''}. "
          "Resume with the config it was written with (config.json in the "
          "workdir), or use a fresh --workdir.")

  def close(self):
    self._manager.close()


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def _broadcast(value: int) -> int:
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))
