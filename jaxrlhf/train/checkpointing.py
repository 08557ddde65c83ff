"""Orbax checkpoints of the whole training state, verified before use.

A checkpoint holds the train state pytree (every network's parameters, every
optimizer state, the step, the RNG and the algorithm's carried scalars) and a
small JSON item with the data position. Orbax writes each step into a
temporary directory and renames it when complete (on an object store such as
GCS, where nothing can be renamed, it marks a complete step with a
commit_success.txt instead). After that, process 0 writes
`jaxrlhf_manifest.json` into the step: the size and SHA-256 of every file of
the step. The manifest is our commit mark: a step without one was
interrupted after orbax's commit (or comes from a version of jaxrlhf that
wrote none, when no step has one).

Before a step is restored its files are checked against its manifest. A step
that fails (a flipped byte, a truncated or missing file, no manifest) is
reported in one line naming the step and the file, moved into
`<workdir>/damaged_checkpoints/` (never deleted), and the previous step is
tried; if no step verifies, the run is refused in one line and nothing is
moved. Older steps beyond `keep` are deleted only once a newer one has its
manifest, so the newest complete step is never deleted.

A save that cannot be written (a full disk, a quota) stops the run with one
line saying where and why; its temporary files are removed and the previous
checkpoint is kept.
"""

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import sys
import threading
import time
from typing import Any, List, Optional, Tuple

from etils import epath
from flax import serialization
import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrlhf import checkpoint_files
from jaxrlhf import console
from jaxrlhf.train import files as files_lib

MANIFEST = "jaxrlhf_manifest.json"
DAMAGED = "damaged_checkpoints"
_FORMAT = 1
_CHUNK = 1 << 22
# Files hashed at once: reading from an object store is latency-bound.
_HASH_THREADS = 16
# How long a failed save waits for each of orbax's writer threads to end.
_THREAD_WAIT_S = 60

WriteError = files_lib.WriteError
write_failure = files_lib.write_failure


class CheckpointError(ValueError):
  """No checkpoint can be restored, or one cannot be used."""


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


def _hash_all(step_dir: epath.Path, names: List[str]):
  """{name: (size, sha256)}, hashed in parallel."""
  with concurrent.futures.ThreadPoolExecutor(
      max(1, min(_HASH_THREADS, len(names)))) as pool:
    return dict(zip(names, pool.map(lambda n: _sha256(step_dir / n), names)))


def write_manifest(step_dir) -> None:
  """Writes the step's manifest atomically (a temporary file renamed)."""
  step_dir = epath.Path(step_dir)
  hashed = _hash_all(step_dir, _files(step_dir))
  entries = {name: {"size": size, "sha256": digest}
             for name, (size, digest) in hashed.items()}
  files_lib.write_atomically(
      step_dir / MANIFEST,
      json.dumps({"format": _FORMAT, "files": entries}, indent=1,
                 sort_keys=True))


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
  missing = [n for n in sorted(entries) if not (step_dir / n).exists()]
  if missing:
    return f"file {missing[0]} is missing"
  hashed = _hash_all(step_dir, sorted(entries))
  for name, expected in sorted(entries.items()):
    size, digest = hashed[name]
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
    what = f"the checkpoint of step {step} in {self.directory}"
    running = set(threading.enumerate())
    with _write_failures_held_back():
      try:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave({"position": int(data_position)})),
            force=True)
        self._manager.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except
        failure = write_failure(e, what)
        if failure is None:
          raise
        # Orbax's other writers of this step are still running: let them
        # end before their files are removed, or they write them again.
        _wait_for_threads_started_after(running)
        self._remove_unfinished(step)
        raise failure from None
    # The manifest is written by process 0 alone; every process learns
    # whether it was, so that all of them stop together if not.
    manifest_error = None
    if jax.process_index() == 0:
      try:
        write_manifest(self._step_dir(step))
      except Exception as e:  # pylint: disable=broad-except
        manifest_error = e
    if _broadcast(int(manifest_error is not None)):
      self._remove_unfinished(step)
      if manifest_error is None:
        raise WriteError(f"Could not write {what}: process 0 failed to "
                         "write its manifest (see its output).")
      failure = write_failure(manifest_error, what)
      if failure is None:
        raise manifest_error
      raise failure from None
    self._prune()

  def _remove_unfinished(self, step: int) -> None:
    """Removes what a failed save of `step` left: orbax's temporary
    directory, or the step without its manifest (never complete, so nothing
    is lost)."""
    if jax.process_index() == 0:
      root = epath.Path(self.directory)
      for path in [*root.glob(f"{step}.orbax-checkpoint-tmp*"),
                   self._step_dir(step)]:
        try:
          if path.exists():
            path.rmtree()  # never complete, so nothing is lost
        except OSError:
          pass
    # No barrier: the run stops next, and a process whose own write failed
    # may be the only one here (the others still inside orbax's save).

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
      except Exception as e:  # pylint: disable=broad-except
        # Every process waits for the choice: never leave them waiting.
        refusal = CheckpointError(
            f"Could not check the checkpoints in {self.directory} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ").")
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
      # Written by a jaxrlhf that wrote no manifests, or the very first save
      # was interrupted between orbax's commit and the manifest: complete
      # by orbax's account, but there is nothing to check the files against.
      console.log(f"Checkpoint step {steps[-1]} in {self.directory} has no "
                  f"manifest ({MANIFEST}) and none of its neighbours has "
                  "one: restoring it unverified.")
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
      console.log(f"Checkpoint step {damaged} in {self.directory} cannot be "
                  f"used: {problem}. Moved it to {target}; resuming from "
                  f"step {step}, the newest that verifies.")
    self._manager.reload()
    return step

  def _move_aside(self, step: int) -> epath.Path:
    root = epath.Path(self.directory).parent / DAMAGED
    root.mkdir(parents=True, exist_ok=True)
    target = root / str(step)
    if target.exists():
      target = root / f"{step}.{time.strftime('%Y%m%d-%H%M%S')}"
    _move_tree(self._step_dir(step), target)
    return target

  def restore(self, step: int, abstract_state: Any) -> Tuple[Any, int]:
    """Restores into the shapes, dtypes and shardings of `abstract_state`.

    Args:
      abstract_state: a pytree of jax.ShapeDtypeStruct with `sharding` set,
        the same structure as the saved state, or that structure without
        some of its frozen networks (`_frozen_not_kept`: left unread).
    """
    saved = self._saved_tree(step)
    self._check_parameter_shapes(step, abstract_state, saved)
    unread = self._frozen_not_kept(abstract_state, saved)
    if unread:
      console.log(f"Checkpoint step {step} in {self.directory} holds frozen "
                  f"networks this run no longer keeps ({', '.join(unread)}); "
                  "restoring without them.")
    try:
      if unread:
        restored = self._restore_without(step, abstract_state)
      else:
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
      # Its files verified (or it predates manifests), so this is the
      # structure of the state, not damage.
      raise CheckpointError(
          f"Checkpoint step {step} in {self.directory} could not be restored "
          f"into this run's state ({str(e).splitlines()[0]}): its state has "
          "another structure (another model, optimizer or algorithm). Resume "
          "with the config it was written with (config.json in the "
          "workdir), or use a fresh --workdir for this config.") from e
    return restored["state"], int(restored["data"]["position"])

  def _restore_without(self, step: int, abstract_state: Any):
    """{"state", "data"} of `step`, reading only the subtrees of the saved
    state that `abstract_state` has (orbax's partial restore)."""
    state = checkpoint_files.restore_state(
        self._step_dir(step) / checkpoint_files.STATE_ITEM,
        target=abstract_state,
        restore_args=ocp.checkpoint_utils.construct_restore_args(
            abstract_state),
        partial=True)
    data = self._manager.restore(
        step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    return {"state": state, "data": data}

  def _saved_tree(self, step: int) -> Optional[Any]:
    """The saved state's tree of array metadata; None when unreadable (the
    restore itself will then say what is wrong)."""
    try:
      return checkpoint_files.state_metadata(
          self._step_dir(step) / checkpoint_files.STATE_ITEM)
    except Exception:  # pylint: disable=broad-except
      return None

  @staticmethod
  def _frozen_not_kept(abstract_state: Any, saved: Optional[Any]
                       ) -> List[str]:
    """The frozen networks the checkpoint holds and this run's state does
    not: written when the run kept a copy it no longer needs (an online run
    with no KL term kept its reference before jaxrlhf learnt to drop it).
    Nothing of the run reads them, so leaving them unread loses nothing."""
    if not isinstance(saved, dict) or not isinstance(saved.get("frozen"),
                                                     dict):
      return []
    kept = serialization.to_state_dict(abstract_state).get("frozen") or {}
    return sorted(f"frozen/{name}" for name in saved["frozen"]
                  if name not in kept)

  def _check_parameter_shapes(self, step: int, abstract_state: Any,
                              saved: Optional[Any]) -> None:
    """A one-line error naming the parameters whose saved shapes differ
    from this run's (a changed model config), instead of the storage
    layer's failure partway through reading them."""
    if saved is None:
      return
    saved = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in
             jax.tree_util.tree_flatten_with_path(saved)[0]
             if hasattr(v, "shape")}
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


def _wait_for_threads_started_after(running) -> None:
  """Waits (up to _THREAD_WAIT_S) until the threads that are not in
  `running` have ended, those they start included. Orbax's own threads
  raise their failure again from `join`: the failure of the same write,
  which the caller reports."""
  deadline = time.monotonic() + _THREAD_WAIT_S
  while time.monotonic() < deadline:
    others = [t for t in threading.enumerate()
              if t not in running and t is not threading.current_thread()]
    if not others:
      return
    for thread in others:
      try:
        thread.join(timeout=max(deadline - time.monotonic(), 0))
      except Exception as e:  # pylint: disable=broad-except
        if "before it is started" in str(e):
          time.sleep(0.05)
        elif not _after_a_write_failure(e):
          raise


def _after_a_write_failure(error) -> bool:
  """`error` is a failed write, or what orbax's threads meet after one
  (their event loop closed under them)."""
  return error is not None and (
      write_failure(error, "") is not None or (
          isinstance(error, RuntimeError) and any(
              m in str(error) for m in ("Event loop is closed",
                                        "cannot schedule new futures"))))


@contextlib.contextmanager
def _write_failures_held_back():
  """Orbax's writer threads log a failed write of theirs (and later fail to
  reach their closed event loop, which tensorstore's callback threads print
  as "unraisable" exceptions) before the main thread raises the error, and the
  asyncio tasks that failed with it are reported as "never retrieved" when
  they are collected, after the error line. The run reports a failed write
  in one line, so those reports of a write failure are held back: during
  the save, and once a write failed for the rest of the process (the run
  stops next). Anything else is reported as usual."""

  after_a_write_failure = _after_a_write_failure

  class Filter(logging.Filter):

    def filter(self, record):
      error = record.exc_info[1] if record.exc_info else None
      return not after_a_write_failure(error)

  previous = (threading.excepthook, sys.unraisablehook)

  def thread_hook(args):
    if not after_a_write_failure(args.exc_value):
      previous[0](args)

  def unraisable_hook(args):
    if not after_a_write_failure(args.exc_value):
      previous[1](args)

  record_filter = Filter()
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
  for logger in loggers:
    logger.addFilter(record_filter)
  threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook
  failed = False
  try:
    yield
  except BaseException:
    failed = True
    raise
  finally:
    if not failed:
      for logger in loggers:
        logger.removeFilter(record_filter)
      threading.excepthook, sys.unraisablehook = previous


def _move_tree(source: epath.Path, target: epath.Path) -> None:
  """Moves a directory: a rename, or where renaming a directory is not
  possible (an object store) a copy of every file, then the removal."""
  try:
    source.rename(target)
    return
  except (OSError, NotImplementedError):
    if target.exists() and not source.exists():
      return
  for folder, _, names in source.walk():
    folder = epath.Path(folder)
    for name in names:
      destination = target / (folder / name).relative_to(source)
      destination.parent.mkdir(parents=True, exist_ok=True)
      (folder / name).copy(destination)
  source.rmtree()


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def _broadcast(value: int) -> int:
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))
