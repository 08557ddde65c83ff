"""Math answers compared in a process of their own, each with a time limit.

math-verify bounds its parsing and comparing with `signal.alarm`, which
works only in a process's main thread, and only between Python bytecodes.
A host reward runs in a worker thread (`rewards.host`), where that limit is
off, and a completion such as "\\boxed{10^{10^{10}}}" then makes sympy
compute a ten-billion-digit integer in one C call that holds the
interpreter's lock: the whole training process stops, its own time limits
included. So the comparisons run in a child process, in its main thread
(where math-verify's limit applies), with a bounded address space, and the
parent waits for each row's answer at most `row_limit_s` seconds; a row
that takes longer scores as a wrong answer (as math-verify's own timeout
does), the child is killed and a fresh one answers the remaining rows.

  verifier = VerifierProcess(verify_timeout_s=5)
  equal, timed_out = verifier.compare([(answer, reference), ...])

The equality is `answers_match` (math-verify's `parse` then `verify`; the
same text when either side does not parse), which the child runs. It keeps
math-verify's limit (`verify_timeout_s`) in the main thread and turns it
off in any other, where `signal.alarm` raises.

The child is `python -m jaxrlhf.rewards.verifier_process <seconds>`: it
reads one JSON list of [answer, reference] pairs per line on its standard
input and writes one JSON boolean per pair on its own protocol stream (its
standard output; what the libraries print goes to /dev/null); it ends when
its input closes, so it never outlives the parent.
"""

import atexit
import functools
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence, Tuple

# The child's own start (its interpreter, math-verify, sympy), waited for
# before the first row.
_START_LIMIT_S = 120.0
# The child's address space: an answer whose value sympy would build in
# memory (a huge power) fails there with a MemoryError, a wrong answer,
# instead of taking the host's memory from the training process. A
# comparison takes about 120 MB.
_MEMORY_LIMIT_BYTES = 4 << 30


# --- equality with math-verify ------------------------------------------------

class _QuietTimeoutWarning(logging.Filter):
  """math-verify warns once that its timeout is off; ours is on."""

  def filter(self, record):
    return not record.getMessage().startswith("Timeout is disabled")


@functools.lru_cache(maxsize=None)
def load_math_verify():
  """The math_verify module, its timeout warning quieted."""
  # Imported on first use: math-verify brings sympy (seconds to import).
  import math_verify  # pylint: disable=g-import-not-at-top
  for name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(name).addFilter(_QuietTimeoutWarning())
  return math_verify


def _signal_timeout(seconds: int) -> Optional[int]:
  if threading.current_thread() is threading.main_thread():
    return seconds
  return None


def _parse(answer: str, timeout: Optional[int]) -> list:
  text = answer.strip()
  if not (text.startswith("$") and text.endswith("$") and len(text) > 1):
    text = f"${text}$"
  return load_math_verify().parse(text, parsing_timeout=timeout)


def answers_match(answer: str, reference: str, *,
                  verify_timeout_s: int = 5) -> bool:
  """Whether two extracted answers are equal as math (`math-verify`); when
  either cannot be parsed, whether they are the same text."""
  timeout = _signal_timeout(verify_timeout_s)
  gold, guess = _parse(reference, timeout), _parse(answer, timeout)
  if not gold or not guess:
    return answer.strip() == reference.strip()
  return bool(load_math_verify().verify(gold, guess, timeout_seconds=timeout))


# --- the verifier process -----------------------------------------------------

class VerifierProcess:
  """A child process comparing math answers (module docstring); started on
  the first comparison, restarted after a row that overran its limit."""

  def __init__(self, verify_timeout_s: int = 5,
               row_limit_s: Optional[float] = None):
    """verify_timeout_s: math-verify's limit per parse or comparison, in the
    child. row_limit_s: the most seconds the parent waits for one row's
    answer (default: the three limits of a row's two parses and its
    comparison, plus 5 s)."""
    self.verify_timeout_s = int(verify_timeout_s)
    self.row_limit_s = (3.0 * self.verify_timeout_s + 5.0
                        if row_limit_s is None else float(row_limit_s))
    self._child = None
    self._pending = b""  # What the child wrote after the last line read.
    self._lock = threading.Lock()
    atexit.register(self.close)

  def _start(self) -> None:
    # One thread for the numerical libraries: the child needs none, and
    # their per-thread buffers would count against its memory limit.
    # The parent's import path, so that the child finds this package however
    # the parent did (installed, or a path added at run time).
    env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    self._child = subprocess.Popen(
        [sys.executable, "-m", __name__, str(self.verify_timeout_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env=env)
    if self._read(_START_LIMIT_S) != "ready":
      try:  # It closed its output as it exited, or it is still starting.
        status = self._child.wait(timeout=5)
      except subprocess.TimeoutExpired:
        status = None
      self.close()
      raise RuntimeError(
          f"math answer reward: the verifier process (python -m {__name__}) "
          + (f"exited with status {status} as it started; run that command "
             "to see why." if status is not None else
             f"did not start within {_START_LIMIT_S:g} s."))

  def _read(self, limit_s: float) -> Optional[str]:
    """The child's next line within limit_s seconds, or None (also when it
    ended)."""
    deadline = time.monotonic() + limit_s
    fd = self._child.stdout.fileno()
    while b"\n" not in self._pending:
      left = deadline - time.monotonic()
      ready, _, _ = select.select([fd], [], [], max(left, 0.0))
      if not ready:
        return None
      chunk = os.read(fd, 4096)
      if not chunk:
        return None
      self._pending += chunk
    line, self._pending = self._pending.split(b"\n", 1)
    return line.decode().strip()

  def close(self) -> None:
    """Ends the child (killed: it may be inside a computation that does not
    return)."""
    child, self._child = self._child, None
    self._pending = b""
    if child is None:
      return
    child.kill()
    child.wait()
    for stream in (child.stdin, child.stdout):
      try:
        stream.close()
      except OSError:
        pass

  def compare(self, pairs: Sequence[Tuple[str, str]]
              ) -> Tuple[List[bool], int]:
    """([whether each (answer, reference) pair is equal as math], the number
    of rows that overran row_limit_s and count as not equal)."""
    equal = [False] * len(pairs)
    timed_out = 0
    start = 0
    with self._lock:
      while start < len(pairs):
        if self._child is None or self._child.poll() is not None:
          self.close()
          self._start()
        try:
          self._child.stdin.write(
              (json.dumps([list(p) for p in pairs[start:]]) + "\n").encode())
          self._child.stdin.flush()
        except BrokenPipeError:
          self.close()
          continue  # Started again above.
        for row in range(start, len(pairs)):
          line = self._read(self.row_limit_s)
          if line not in ("true", "false"):
            # Overran its limit, or the child died on it (a memory error):
            # a wrong answer, and a fresh child for the rest.
            self.close()
            timed_out += 1
            start = row + 1
            break
          equal[row] = line == "true"
        else:
          start = len(pairs)
    return equal, timed_out


def _serve(verify_timeout_s: int) -> None:
  """The child's loop (module docstring)."""
  import resource  # pylint: disable=g-import-not-at-top
  resource.setrlimit(resource.RLIMIT_AS,
                     (_MEMORY_LIMIT_BYTES, _MEMORY_LIMIT_BYTES))
  protocol = os.fdopen(os.dup(1), "w")
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)  # What math-verify and sympy print.
  sys.stdout = open(os.devnull, "w")
  load_math_verify()
  protocol.write("ready\n")
  protocol.flush()
  for line in sys.stdin:
    for answer, reference in json.loads(line):
      try:
        equal = answers_match(answer, reference,
                              verify_timeout_s=verify_timeout_s)
      except Exception:  # pylint: disable=broad-except
        equal = False  # A MemoryError included (_MEMORY_LIMIT_BYTES).
      protocol.write("true\n" if equal else "false\n")
      protocol.flush()


if __name__ == "__main__":
  _serve(int(sys.argv[1]))
