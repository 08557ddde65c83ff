"""Runs of several processes: a lost process stops the others in one line.

The processes of a multi-host run wait for one another in every collective
(a train step, a checkpoint's barriers). When one of them dies (kill -9, a
crashed host, a preempted VM that got no SIGTERM), the others would wait
forever on a TPU pod, or fail with a collective's error and then hang in
jax.distributed's shutdown barrier. Instead, each process beats a counter in
the key-value store of jax.distributed's coordination service every few
seconds, and a watch thread reads the others' counters: a process whose
counter has not moved for `train.lost_process_timeout_s` is lost, and this
process prints one line naming it (on stderr) and exits with status 1 at
once, from wherever its main thread is waiting. Run the same command again
on every process: the run resumes from its last complete checkpoint.

JAX's own heartbeat timeout is set above ours (`initialize`), so our line
comes first. One case is JAX's alone: process 0 hosts the coordination
service, and when it is lost the other processes lose their connection to
it and are stopped by JAX at once, with its message "Terminating process
because the JAX distributed service detected fatal errors ... another task
died" (no hang either way).
"""

import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import jax

_KEY = "jaxrlhf/alive/"
_DONE = "done"
# JAX's heartbeat timeout over ours: it must not stop the process first.
JAX_HEARTBEAT_FACTOR = 2
_beats = 0  # this process's counter, kept across runs in one process


def initialize(coordinator_address: Optional[str] = None,
               num_processes: Optional[int] = None,
               process_id: Optional[int] = None,
               lost_process_timeout_s: float = 60) -> None:
  """jax.distributed.initialize, with JAX's heartbeat timeout set above
  `lost_process_timeout_s` (see module doc); None arguments are detected by
  JAX (TPU pods, Slurm)."""
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id,
      heartbeat_timeout_seconds=int(JAX_HEARTBEAT_FACTOR
                                    * lost_process_timeout_s) + 1)
  if (jax.process_count() > 1 and jax.default_backend() == "cpu"
      and jax.config.jax_cpu_collectives_implementation == "gloo"):
    _connect_gloo_quietly()


def _connect_gloo_quietly() -> None:
  """Gloo, JAX's collectives between the processes of a CPU run, prints
  "[Gloo] Rank N is connected to M peer ranks ..." on the process's stdout
  (from C++, past Python's sys.stdout) when it connects, at the first
  collective. Connect it now with a barrier over every device, stdout's
  file descriptor pointed at /dev/null meanwhile; later collectives reuse
  the connection and print nothing."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  sys.stdout.flush()
  saved = os.dup(1)
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, 1)
    multihost_utils.sync_global_devices("jaxrlhf: collectives connected")
  finally:
    os.dup2(saved, 1)
    os.close(saved)
    os.close(devnull)


def _client():
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


class PeerWatch:
  """Watches the other processes of the run (see module doc); a no-op on a
  single process.

  Args:
    timeout_s: a process not heard from for this long is lost.
    on_lost: called (on the watch thread) before this process exits, e.g. to
      release the workdir lock.
  """

  def __init__(self, timeout_s: float,
               on_lost: Optional[Callable[[], None]] = None):
    self._active = jax.process_count() > 1 and _client() is not None
    self._timeout = float(timeout_s)
    self._interval = min(max(self._timeout / 8, 0.25), 5.0)
    self._on_lost = on_lost
    self._stop = threading.Event()
    self._verdict = threading.Event()
    self._me = jax.process_index()
    # process -> (last counter value seen, local time it last changed);
    # a process never heard from is judged by JAX's own start-up timeouts.
    self._seen: Dict[int, tuple] = {}
    self._thread: Optional[threading.Thread] = None

  def __enter__(self):
    if self._active:
      self._beat()
      self._thread = threading.Thread(target=self._watch, daemon=True,
                                      name="jaxrlhf-peer-watch")
      self._thread.start()
    return self

  def __exit__(self, exc_type, exc, tb):
    if not self._active:
      return
    if exc is not None and _collective_failure(exc):
      # The step or save failed because a peer went away: wait for the
      # watch to name it (it then ends this process) rather than print the
      # collective's traceback and hang in jax.distributed's shutdown.
      self._verdict.wait(self._timeout + 4 * self._interval)
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    try:  # a process that finished is not lost
      _client().key_value_set(f"{_KEY}{self._me}", _DONE,
                              allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass

  def _beat(self):
    global _beats
    _beats += 1
    _client().key_value_set(f"{_KEY}{self._me}", str(_beats),
                            allow_overwrite=True)

  def _watch(self):
    last_contact = time.monotonic()
    while not self._stop.wait(self._interval):
      now = time.monotonic()
      try:
        self._beat()
        values = self._read_others()
        last_contact = now
      except Exception:  # pylint: disable=broad-except
        # The coordination service (on process 0) cannot be reached.
        if now - last_contact > self._timeout:
          self._lost([0], now - last_contact)
        continue
      for process, value in values.items():
        if value is None:
          continue
        seen = self._seen.get(process)
        if seen is None or seen[0] != value or value == _DONE:
          self._seen[process] = (value, now)
      lost = [p for p, (_, since) in sorted(self._seen.items())
              if now - since > self._timeout]
      if lost:
        self._lost(lost, max(now - self._seen[p][1] for p in lost))

  def _read_others(self) -> Dict[int, Optional[str]]:
    client, out = _client(), {}
    for process in range(jax.process_count()):
      if process == self._me:
        continue
      try:
        out[process] = client.key_value_try_get(f"{_KEY}{process}")
      except Exception as e:  # pylint: disable=broad-except
        if "NOT_FOUND" not in str(e) and "not found" not in str(e).lower():
          raise
        out[process] = None  # not started watching yet
    return out

  def _lost(self, processes: List[int], silent_s: float) -> None:
    self._verdict.set()
    names = ", ".join(str(p) for p in processes)
    which = (f"process {names}" if len(processes) == 1
             else f"processes {names}")
    count = jax.process_count()
    message = (
        f"error: {which} of {count} stopped responding (nothing heard from "
        f"it for {silent_s:.0f} s; config.train.lost_process_timeout_s is "
        f"{self._timeout:g}): it died or its host was lost. Process "
        f"{self._me} stops too. Run the same command again on every process "
        "to resume from the last complete checkpoint.")
    try:
      if self._on_lost is not None:
        self._on_lost()
    finally:
      sys.stdout.flush()
      print(message, file=sys.stderr, flush=True)
      # The main thread may be inside a collective that never returns.
      os._exit(1)  # pylint: disable=protected-access


def _collective_failure(error: BaseException) -> bool:
  """Whether `error` is the runtime's (a collective or a barrier that
  failed), as opposed to one of ours (a refused config, a non-finite step)."""
  text = str(error)
  if type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError") or any(
      marker in text for marker in ("DEADLINE_EXCEEDED", "UNAVAILABLE",
                                    "Gloo", "Connection reset by peer")):
    return True  # (jit re-raises some of them as ValueError)
  return False
