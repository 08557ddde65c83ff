"""The workdir of a run: its lock, its config.json, and the checks that keep
it describing one run.

- The lock (`WorkdirLock`): process 0 creates `<workdir>/run.lock` holding
  its host, PID and start time, refreshes it every 30 seconds, and removes
  it on exit. A second run on the same workdir is refused in one line naming the
  holder. A lock left by a run that is gone is taken over with a line saying
  so: on the same host when its process no longer exists (a kill -9), on
  another host when it has not been refreshed for `STALE_AFTER_S` (a lost
  VM: a preempted job restarts on another one).
- `config.json` is written atomically once the run has started. A run that
  resumes from checkpoints compares its config with the one they were
  written under (`check_resumed_config`): a changed field that defines the
  run (the model, the data, the optimizer, the batch size, the seed, ...)
  refuses the resume in one line naming the fields; a field declared
  `resumable` (how long it trains, how often it logs, saves and evaluates,
  the device layout) may change, with a line naming the change, and the
  previous config is kept as `config.before_step_<N>.json`.
"""

import datetime
import json
import os
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

from etils import epath
import jax
import ml_collections
import numpy as np

from jaxrlhf import algorithms
from jaxrlhf import config_schema
from jaxrlhf import console
from jaxrlhf import defaults
from jaxrlhf.train import files

LOCK = "run.lock"
CONFIG = "config.json"
# A lock from another host not refreshed for this long is a lost run's (a
# preempted job restarted on another VM takes over a few minutes later).
STALE_AFTER_S = 150
_REFRESH_S = 30


class WorkdirError(ValueError):
  """The workdir cannot be used (not writable, or held by another run)."""


class ConfigChangedError(ValueError):
  """A resume whose config differs from its checkpoints' in a field that
  defines the run."""


def check_workdir(workdir: str) -> None:
  """Creates the workdir; a one-line WorkdirError if it is not writable."""
  path = epath.Path(workdir)
  probe = path / f".write_test_{jax.process_index()}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    failure = files.write_failure(e, f"the workdir {workdir}")
    if failure is not None:
      raise failure from None
    # One line: TensorFlow's messages (gs:// paths) hold newlines.
    reason = " ".join(str(e.strerror or e).split())
    raise WorkdirError(
        f"--workdir {workdir!r} is not a writable directory "
        f"({reason}); choose a path you can write to.") from e


def config_text(config: ml_collections.ConfigDict) -> str:
  return config.to_json_best_effort(indent=2, sort_keys=True)


def write_run_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Writes the resolved config as `config.json` (atomically, process 0)."""
  if jax.process_index() == 0:
    path = epath.Path(workdir) / CONFIG
    files.write_atomically(path, config_text(config), f"{path}")


# --- a resumed run's config ---------------------------------------------------


def _canonical(value):
  """A value as config.json holds it (tuples are lists)."""
  return json.loads(json.dumps(value, default=str))


def _run_fields(config) -> List[Tuple[str, config_schema.Field, bool]]:
  """(path, Field, resumable) of the fields of a run of config.algorithm:
  the shared groups and the algorithm's own (other algorithms' groups do
  not affect it)."""
  groups = list(defaults.SHARED) + list(
      algorithms.get(config.algorithm).config_groups)
  resumable = set(config_schema.resumable_paths(groups))
  return [(path, field, path in resumable)
          for path, field in config_schema.walk(groups)]


def _lookup(tree: Dict, path: str):
  node = tree
  for name in path.split("."):
    if not isinstance(node, dict) or name not in node:
      raise KeyError(path)
    node = node[name]
  return node


def check_resumed_config(workdir: str, config: ml_collections.ConfigDict,
                         step: int) -> Optional[str]:
  """Compares `config` with the workdir's config.json (the config its
  checkpoints were written under) when resuming at `step`.

  Returns:
    None when nothing changed, else a line naming the resumable fields that
    changed (the previous config.json is then kept as
    config.before_step_<step>.json by `keep_previous_config`).
  Raises:
    ConfigChangedError: a field that defines the run changed (one line
      naming each with both values).
  """
  path = epath.Path(workdir) / CONFIG
  if not path.exists():
    return None
  try:
    saved = json.loads(path.read_text())
  except ValueError:
    return None  # unreadable: nothing to compare; it is rewritten
  current = json.loads(config_text(config))
  if saved.get("algorithm") != current.get("algorithm"):
    raise ConfigChangedError(
        f"config.algorithm is {saved.get('algorithm')!r} in the run whose "
        f"checkpoints are in {workdir} ({CONFIG}), {current.get('algorithm')!r}"
        " now: use a fresh --workdir (init.policy_checkpoint can start from "
        "this one's policy).")
  defining, resumable = [], []
  for field_path, _, may_change in _run_fields(config):
    try:
      before = _canonical(_lookup(saved, field_path))
    except KeyError:
      continue  # written by a version without this field
    after = _canonical(_lookup(current, field_path))
    if before != after:
      change = f"config.{field_path} {before!r} -> {after!r}"
      (resumable if may_change else defining).append(change)
  if defining:
    raise ConfigChangedError(
        f"Resuming the run in {workdir} at step {step} with a changed config "
        f"({'; '.join(defining)}): its checkpoints were written under the "
        f"old values ({CONFIG}). Run with those values to resume, or use a "
        "fresh --workdir for the new run (init.policy_checkpoint can start "
        "from this one's policy).")
  if resumable:
    return (f"Resuming at step {step} with {'; '.join(resumable)}; the "
            f"previous config is kept as config.before_step_{step}.json.")
  return None


def keep_previous_config(workdir: str, step: int) -> None:
  """Keeps config.json as config.before_step_<step>.json (process 0)."""
  if jax.process_index() != 0:
    return
  path = epath.Path(workdir) / CONFIG
  if path.exists():
    target = epath.Path(workdir) / f"config.before_step_{step}.json"
    files.write_atomically(target, path.read_text(), f"{target}")


# --- the lock -------------------------------------------------------------------


def _process_start(pid: int) -> Optional[str]:
  """The start time of process `pid` in clock ticks since boot (Linux), to
  tell a live holder from a later process that reuses its PID."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      # The command name (field 2) may hold spaces; it ends at the last ')'.
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive_here(pid: int, start: Optional[str]) -> bool:
  """Whether the process that wrote a lock on this host still runs."""
  if pid == os.getpid():
    return False  # a lock of an earlier life of this PID (a restarted container)
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # another user's process: it exists
  now_start = _process_start(pid)
  return start is None or now_start is None or now_start == start


def _describe(holder: Dict) -> str:
  return (f"process {holder.get('pid')} on host {holder.get('host')!r}, "
          f"started {holder.get('started')}")


class WorkdirLock:
  """The workdir's lock for the duration of a run (see module doc).

  Process 0 holds the file; every process learns the outcome, so all of them
  refuse together. Usable as a context manager.
  """

  def __init__(self, workdir: str):
    self._path = epath.Path(workdir) / LOCK
    self._workdir = workdir
    self._record: Optional[Dict] = None
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()

  def acquire(self) -> None:
    refusal = None
    if jax.process_index() == 0:
      try:
        self._acquire_here()
      except WorkdirError as e:
        refusal = e
    refused = _from_process_0(refusal is not None)
    if refused:
      raise refusal or WorkdirError(
          f"--workdir {self._workdir!r} is held by another run (process 0 "
          "names it).")
    if self._record is not None:
      self._thread = threading.Thread(target=self._refresh, daemon=True,
                                      name="jaxrlhf-workdir-lock")
      self._thread.start()

  def _acquire_here(self) -> None:
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "process_start": _process_start(os.getpid()),
              "started": datetime.datetime.now().astimezone().isoformat(
                  timespec="seconds"),
              "refreshed": time.time()}
    for _ in range(3):
      if self._create(record):
        self._record = record
        # A refresh of an earlier holder cut short by a kill.
        leftover = self._path.parent / (self._path.name + ".tmp")
        if leftover.exists():
          leftover.unlink()
        return
      holder = self._read()
      if holder is None:
        continue  # released meanwhile, or unreadable: try again
      why_stale = self._stale(holder)
      if why_stale is None:
        raise WorkdirError(
            f"--workdir {self._workdir!r} is in use by another run "
            f"({_describe(holder)}; {self._path}). Wait for it to finish, "
            "stop it, or use another --workdir; if that run is gone, "
            f"delete {self._path}.")
      console.log(f"Taking over the lock of {self._workdir} from "
                  f"{_describe(holder)}: {why_stale}.")
      self._remove_if(holder)
    raise WorkdirError(f"Could not take the lock {self._path}: other runs "
                       "keep taking it.")

  def _create(self, record: Dict) -> bool:
    """Creates the lock file if there is none (atomically where the file
    system allows it: O_EXCL on a local one)."""
    text = json.dumps(record, sort_keys=True)
    try:
      if files.is_remote(self._path):
        # Object stores have no exclusive create: check, write, read back.
        if self._path.exists():
          return False
        self._path.write_text(text)
        return self._read() == record
      fd = os.open(os.fspath(self._path), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                   0o644)
    except FileExistsError:
      return False
    except OSError as e:
      failure = files.write_failure(e, f"the lock {self._path}")
      if failure is not None:
        raise failure from None
      raise
    try:
      with os.fdopen(fd, "w") as f:
        f.write(text)
    except OSError as e:
      os.unlink(self._path)
      failure = files.write_failure(e, f"the lock {self._path}")
      if failure is not None:
        raise failure from None
      raise
    return True

  def _read(self) -> Optional[Dict]:
    try:
      return json.loads(self._path.read_text())
    except (OSError, ValueError):
      return None

  def _stale(self, holder: Dict) -> Optional[str]:
    """Why the holder is gone, or None if it may still be running."""
    if holder.get("host") == socket.gethostname():
      if not _alive_here(int(holder.get("pid", -1)), holder.get(
          "process_start")):
        return "that process no longer exists"
      return None
    age = time.time() - float(holder.get("refreshed", 0))
    if age > STALE_AFTER_S:
      return f"not refreshed for {age / 60:.0f} minutes"
    return None

  def _remove_if(self, holder: Dict) -> None:
    if self._read() == holder:
      try:
        self._path.unlink()
      except FileNotFoundError:
        pass

  def _refresh(self):
    while not self._stop.wait(_REFRESH_S):
      record = dict(self._record, refreshed=time.time())
      try:
        files.write_atomically(self._path, json.dumps(record, sort_keys=True),
                         f"{self._path}")
        self._record = record
      except Exception:  # pylint: disable=broad-except
        pass  # a full disk is reported by the run's own writes

  def release(self) -> None:
    """Removes the lock if this run holds it (safe to call twice)."""
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join()
    if self._record is not None:
      try:
        if self._read() == self._record:
          self._path.unlink()
      except OSError:
        pass
      self._record = None


def _from_process_0(value: bool) -> bool:
  """`value` as process 0 has it, on every process."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(multihost_utils.broadcast_one_to_all(np.int32(value)))
