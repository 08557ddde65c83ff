"""A reward for code: the share of a row's unit tests that the completion's
code passes, run in a separate, limited process, never in ours.

`make_code_reward(tests_column="tests", ...)` makes a reward function (the
`jaxrlhf.rewards` convention). A row's tests are a list of Python snippets,
each one test (MBPP's `test_list`: "assert f(3) == 9"), or one string (one
test, e.g. HumanEval's `check(candidate)` code with the call appended); no
tests (None or an empty list) means the reward does not apply (None).
The code is the last ```python (or ```py) fenced block of the completion
(an unclosed one runs to the end), else the whole completion. The reward is
the fraction of tests passed (`scoring="fraction"`) or 1.0 only when all
pass (`scoring="all"`). `run_tests(code, tests, ...)` runs one row and says
what happened (`CodeRun`).

How a row runs. A fresh `python -I` (isolated mode: no PYTHON* variables,
no user site-packages, not the current directory on the path) starts in a
new session, so it and every process it starts share one process group. It
reads its job (code, tests, limits) from an unlinked temporary file passed
as a file descriptor and closed before the code runs, sets its limits, runs
the code, then each test in the code's namespace, and writes each test's
outcome, tagged with a random token the code is not given, to another
unlinked file. A test passes only when its line with the token is there:
printing "passed" or exiting early passes nothing.

* Time: `timeout_s` of wall clock for the whole row (start-up, code and all
  tests); then the process group is killed (SIGKILL). The group is killed
  after every run too, so children the code started (a fork that outlives
  it) die with it. Tests not reported by then fail. A CPU-time limit of
  `timeout_s` + 1 s backs it up.
* Memory: RLIMIT_AS (address space) of `memory_mb`, soft and hard, so an
  allocation past it raises MemoryError in the code.
* Files: the working directory is a fresh scratch directory (also HOME and
  TMPDIR), removed afterwards; no file it writes may exceed
  `MAX_FILE_BYTES` (RLIMIT_FSIZE); no core dumps.
* Network, by `network`: "namespace" runs the process in a new network
  namespace with only a loopback interface that is down (`unshare -rn`: a
  user namespace, for which no privilege is needed where the kernel allows
  them): no connection can be made, by Python or by any program it starts.
  Where that is not possible, "audit_hook" is what remains: an audit hook
  (`sys.addaudithook`, which Python code cannot remove) refuses every
  socket operation and the starting of other programs (exec, spawn,
  subprocess, os.system) and loading C functions through ctypes, and the
  proxy variables point at a closed port. "auto" (the default) takes the
  namespace when `unshare -rn` works here, and says which it took
  (`CodeRun.network`, `network_protection()`). The audit hook for sockets
  is installed in every case.
* Stronger, where the machine offers it: "bubblewrap" (taken first by
  "auto" when the `bwrap` program runs here: Debian's and Ubuntu's package
  `bubblewrap`) runs the child in bubblewrap's namespaces: every one of
  them unshared (network, process ids, IPC, host name, user), the whole
  filesystem read-only except its scratch directory, and the child killed
  with its parent. The code then cannot write
  outside its scratch directory, see or signal the trainer's processes, or
  outlive the run by `setsid` (its process-id namespace dies with it).
* Environment: only PATH, HOME, TMPDIR, LANG and the proxy variables; no
  variable of ours (tokens, keys) reaches the code. Standard input is
  /dev/null. The output (stdout and stderr together) is kept up to
  `max_output_bytes`.

What it protects against and what it does not (without bubblewrap; with
it, the filesystem, process and session escapes below are closed, the rest
stands). It stops the accidents of
model-written code: infinite loops, runaway memory, stray files in the
working directory, left-over child processes, network calls, and a policy
learning to fake a pass by printing or exiting. It is not a security
sandbox against a determined attacker: the code runs as the same user as
the trainer (root, if the trainer is root), with no seccomp filter, no
separate filesystem or mount namespace (it can read and write anything that
user can: absolute paths, other users' world-readable files, ours), no
process-id namespace (it sees and can signal the user's other processes),
and in the same Python process as the harness (introspection can reach the
harness's token; ctypes or a C extension can bypass the audit hook). A
process that starts a new session (setsid) leaves the process group and
survives the kill. The number of processes is not limited (a fork bomb
lasts until the time limit). Only POSIX systems are supported. Run untrusted
code in a container or VM with no credentials if that matters.
"""

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from typing import Callable, List, Optional, Sequence

from jaxrlhf import checks

LANGUAGES = ("python",)
NETWORK_MODES = ("auto", "bubblewrap", "namespace", "audit_hook")
SCORING = ("fraction", "all")
# No file the code writes may be larger (RLIMIT_FSIZE).
MAX_FILE_BYTES = 16 * 2**20
# The proxy every client library would use goes to the discard port.
_NOWHERE = "http://127.0.0.1:9"

# Audit events the harness refuses (prefixes). Sockets always; starting
# other programs and ctypes only where no network namespace holds them.
_SOCKET_EVENTS = ("socket.",)
_SPAWN_EVENTS = ("os.exec", "os.posix_spawn", "os.spawn", "os.system",
                 "subprocess.Popen", "pty.spawn", "ctypes.")

# The child's program (`python -I -c _HARNESS <job fd>`). It keeps what it
# needs in locals and runs the code in a namespace of its own.
_HARNESS = r"""
import json, os, resource, signal, sys
def _run():
  with os.fdopen(int(sys.argv[1]), "rb") as f:
    job = json.loads(f.read())
  for name, value in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  results = os.fdopen(job["results_fd"], "w")
  token, blocked = job["token"], tuple(job["blocked"])
  def hook(event, args):
    if event.startswith(blocked):
      raise PermissionError("refused by the code reward's sandbox: " + event)
  sys.addaudithook(hook)
  def report(*fields):
    results.write(json.dumps([token] + list(fields)) + "\n")
    results.flush()
  def why(e):
    lines = str(e).strip().splitlines()
    return type(e).__name__ + (": " + lines[0] if lines else "")
  namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
  tests = job["tests"]
  try:
    exec(compile(job["code"], "<solution>", "exec"), namespace)
  except BaseException as e:
    report("code_error", why(e))
    tests = []
  for i, test in enumerate(tests):
    try:
      exec(compile(test, "<test %d>" % i, "exec"), namespace)
      report("pass", i)
    except BaseException as e:
      report("fail", i, why(e))
  results.close()
  sys.stdout.flush()
  os._exit(0)
_run()
"""


@functools.lru_cache(maxsize=None)
def namespace_available() -> bool:
  """Whether `unshare -rn` can start a process in a new network namespace
  here (user namespaces allowed and the unshare tool present)."""
  unshare = shutil.which("unshare")
  if unshare is None:
    return False
  try:
    done = subprocess.run([unshare, "-rn", "true"], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=30, check=False)
  except (OSError, subprocess.SubprocessError):
    return False
  return done.returncode == 0


@functools.lru_cache(maxsize=None)
def bubblewrap_available() -> bool:
  """Whether `bwrap` runs a program in the sandbox `run_tests` asks of it
  here (the program installed, and namespaces allowed)."""
  bwrap = shutil.which("bwrap")
  if bwrap is None:
    return False
  scratch = tempfile.mkdtemp(prefix="jaxrlhf_bwrap_")
  try:
    done = subprocess.run(_bubblewrap(bwrap, scratch) + ["true"],
                          stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=30, check=False)
  except (OSError, subprocess.SubprocessError):
    return False
  finally:
    _remove_tree(scratch)
  return done.returncode == 0


def _bubblewrap(bwrap: str, scratch: str) -> List[str]:
  """bubblewrap's command line before the program (module docstring)."""
  # (No empty /tmp over the host's: the Python that runs the code may live
  # there, a virtual environment's; the host's is read-only like the rest.)
  return [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
          "--bind", scratch, scratch, "--chdir", scratch,
          "--unshare-all", "--die-with-parent"]


def network_protection(network: str = "auto") -> str:
  """The protection `network` gives here: "bubblewrap", "namespace" or
  "audit_hook" (module docstring)."""
  checks.check_choice("code reward", "network", network, NETWORK_MODES)
  if network == "audit_hook":
    return "audit_hook"
  if network in ("auto", "bubblewrap") and bubblewrap_available():
    return "bubblewrap"
  if network == "bubblewrap":
    raise ValueError("code reward: network='bubblewrap' needs the bwrap "
                     "program (apt-get install bubblewrap) and namespaces "
                     "allowed by the kernel, which do not work here; use "
                     "network='auto' to fall back.")
  if namespace_available():
    return "namespace"
  if network == "namespace":
    raise ValueError("code reward: network='namespace' needs `unshare -rn` "
                     "(util-linux, and user namespaces allowed by the "
                     "kernel), which does not work here; use network='auto' "
                     "to fall back to the audit hook.")
  return "audit_hook"


_FENCE = re.compile(r"```[ \t]*(python3?|py)[ \t]*\n(.*?)(?:```|\Z)",
                    re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
  """The last ```python (```py, ```python3) fenced block of a completion
  (an unclosed one runs to the end), else the whole completion."""
  blocks = _FENCE.findall(completion)
  return blocks[-1][1] if blocks else completion


@dataclasses.dataclass
class CodeRun:
  """What happened when code ran against its tests.

  Attributes:
    tests_passed: [num_tests] whether each test passed.
    timed_out: the time limit killed it.
    returncode: the process's exit status (negative: killed by that signal).
    code_error: the exception the code itself raised (type and first line;
      then no test ran), or None.
    output: its stdout and stderr, up to max_output_bytes.
    network: the network protection that applied: "namespace" or
      "audit_hook".
  """
  tests_passed: List[bool]
  timed_out: bool
  returncode: Optional[int]
  code_error: Optional[str]
  output: str
  network: str

  @property
  def fraction_passed(self) -> float:
    if not self.tests_passed:
      return 0.0
    return sum(self.tests_passed) / len(self.tests_passed)


def _remove_tree(path: str) -> None:
  """rmtree that first gives back the permissions code may have taken."""
  def retry(function, name, _):
    os.chmod(os.path.dirname(name), stat.S_IRWXU)
    if os.path.isdir(name) and not os.path.islink(name):
      os.chmod(name, stat.S_IRWXU)
    function(name)
  shutil.rmtree(path, onerror=retry)


def _limits(timeout_s: float, memory_mb: int) -> dict:
  return {"RLIMIT_AS": memory_mb * 2**20,
          "RLIMIT_CPU": int(math.ceil(timeout_s)) + 1,
          "RLIMIT_FSIZE": MAX_FILE_BYTES,
          "RLIMIT_CORE": 0}


def _read_results(results, token: str, num_tests: int):
  passed = [False] * num_tests
  code_error = None
  results.seek(0)
  for line in results.read(2**20).decode("utf-8", "replace").splitlines():
    try:
      fields = json.loads(line)
    except ValueError:
      continue
    if not isinstance(fields, list) or len(fields) < 2 or fields[0] != token:
      continue  # Not the harness's (the code wrote to the descriptor).
    if fields[1] == "pass" and isinstance(fields[2], int) and (
        0 <= fields[2] < num_tests):
      passed[fields[2]] = True
    elif fields[1] == "code_error":
      code_error = str(fields[2])
  return passed, code_error


def run_tests(code: str, tests: Sequence[str], *, timeout_s: float = 5.0,
              memory_mb: int = 512, max_output_bytes: int = 65536,
              network: str = "auto") -> CodeRun:
  """Runs `code`, then each test, in a limited child process (module
  docstring).

  Args:
    code: Python source.
    tests: Python snippets, each one test (an assert statement, a call).
    timeout_s: wall-clock seconds for the whole run.
    memory_mb: the address-space limit in MiB.
    max_output_bytes: how much of stdout and stderr to keep.
    network: "auto", "namespace" or "audit_hook".
  """
  where = "code reward"
  if not timeout_s > 0:
    raise ValueError(f"{where}: timeout_s={timeout_s!r} must be > 0.")
  if not (isinstance(memory_mb, int) and memory_mb >= 64):
    raise ValueError(f"{where}: memory_mb={memory_mb!r} must be a whole "
                     "number >= 64 (Python itself needs tens of MiB).")
  protection = network_protection(network)
  token = secrets.token_hex(16)
  blocked = _SOCKET_EVENTS + (_SPAWN_EVENTS if protection == "audit_hook"
                              else ())
  scratch = tempfile.mkdtemp(prefix="jaxrlhf_code_")
  command = [sys.executable, "-I", "-c", _HARNESS]
  if protection == "namespace":
    command = [shutil.which("unshare"), "-rn"] + command
  elif protection == "bubblewrap":
    command = _bubblewrap(shutil.which("bwrap"), scratch) + command
  env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch,
         "LANG": "C.UTF-8"}
  for name in ("http_proxy", "https_proxy", "all_proxy", "ftp_proxy"):
    env[name] = env[name.upper()] = _NOWHERE
  env["no_proxy"] = env["NO_PROXY"] = ""
  timed_out, returncode = False, None
  with tempfile.TemporaryFile() as job_file, \
      tempfile.TemporaryFile() as results, \
      tempfile.TemporaryFile() as output:
    job = {"code": code, "tests": list(tests), "token": token,
           "blocked": blocked, "results_fd": results.fileno(),
           "limits": _limits(timeout_s, memory_mb)}
    job_file.write(json.dumps(job).encode())
    job_file.seek(0)
    try:
      process = subprocess.Popen(
          command + [str(job_file.fileno())], cwd=scratch, env=env,
          stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
          pass_fds=(job_file.fileno(), results.fileno()),
          start_new_session=True)
      try:
        returncode = process.wait(timeout=timeout_s)
      except subprocess.TimeoutExpired:
        timed_out = True
      finally:
        # The whole group: the code's own children too, even if it ended.
        try:
          os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass
        returncode = process.wait()
    finally:
      _remove_tree(scratch)
    passed, code_error = _read_results(results, token, len(job["tests"]))
    output.seek(0)
    text = output.read(max_output_bytes).decode("utf-8", "replace")
  return CodeRun(tests_passed=passed, timed_out=timed_out,
                 returncode=returncode, code_error=code_error, output=text,
                 network=protection)


def _row_tests(value, row: int, column: str) -> Optional[List[str]]:
  if value is None:
    return None
  if isinstance(value, str):
    return [value] if value.strip() else None
  if isinstance(value, (list, tuple)) and all(isinstance(t, str)
                                              for t in value):
    return list(value) or None
  raise ValueError(f"code reward: row {row}: column {column!r} holds "
                   f"{type(value).__name__} {str(value)[:60]!r}; tests are a "
                   "list of Python snippets or one string.")


def make_code_reward(tests_column: str = "tests", *, timeout_s: float = 5.0,
                     memory_mb: int = 512, language: str = "python",
                     scoring: str = "fraction", network: str = "auto",
                     max_workers: Optional[int] = None,
                     max_output_bytes: int = 65536) -> Callable:
  """A reward function: the share of a row's tests (column `tests_column`)
  that the completion's code passes (`scoring="fraction"`), or 1.0 when all
  pass and 0.0 otherwise (`scoring="all"`); None for rows without tests.

  Rows run in parallel, `max_workers` processes at a time (default: the
  CPU count), so a batch takes about ceil(rows / max_workers) * timeout_s
  at worst: give the host call's time limit room for that. Other arguments
  are `run_tests`'.
  """
  where = "make_code_reward"
  checks.check_choice(where, "language", language, LANGUAGES)
  checks.check_choice(where, "scoring", scoring, SCORING)
  checks.check_choice(where, "network", network, NETWORK_MODES)
  if not (isinstance(tests_column, str) and tests_column.isidentifier()):
    raise ValueError(f"{where}: tests_column={tests_column!r} must be a "
                     "column name (a Python identifier).")
  workers = max_workers or os.cpu_count() or 1
  run = functools.partial(run_tests, timeout_s=timeout_s,
                          memory_mb=memory_mb, network=network,
                          max_output_bytes=max_output_bytes)

  def score(code: str, tests: Optional[List[str]]) -> Optional[float]:
    if tests is None:
      return None
    result = run(code, tests)
    if scoring == "all":
      return 1.0 if all(result.tests_passed) else 0.0
    return result.fraction_passed

  def code_reward(prompts: Sequence[str], completions: Sequence[str],
                  **columns) -> List[Optional[float]]:
    del prompts
    if tests_column not in columns:
      raise ValueError(
          f"code reward: the rows have no column {tests_column!r} (their "
          f"columns: {sorted(columns)}); set tests_column to the column that "
          "holds the unit tests.")
    tests = [_row_tests(v, i, tests_column)
             for i, v in enumerate(columns[tests_column])]
    codes = [extract_code(c) for c in completions]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      return list(pool.map(score, codes, tests))

  return code_reward
