"""The code reward runs model-written code in a separate, limited process:
passing and failing code, an infinite loop (killed), a memory bomb
(stopped by the limit), a socket (refused: the test's own server sees no
connection), files (only in a scratch directory, removed), a child that
outlives its parent (killed with the process group), faked passes."""

import json
import os
import socket
import sys
import time

import pytest

from jaxrlhf.rewards import code_execution as ce

SQUARE = "def square(x):\n  return x * x\n"
SQUARE_TESTS = ["assert square(3) == 9", "assert square(2) == 4",
                "assert square(0) == 1"]  # The last one is wrong on purpose.

PROTECTIONS = (["audit_hook"]
               + (["namespace"] if ce.namespace_available() else [])
               + (["bubblewrap"] if ce.bubblewrap_available() else []))


def test_extract_code_takes_the_last_python_block():
  text = ("First try:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\n"
          "```text\nnot code\n```")
  assert ce.extract_code(text) == "x = 2\n"
  assert ce.extract_code("Here:\n```python\nx = 3\n") == "x = 3\n"
  assert ce.extract_code("x = 4") == "x = 4"


def test_reward_is_the_share_of_tests_passed():
  reward = ce.make_code_reward(timeout_s=20)
  completions = [f"Here it is:\n```python\n{SQUARE}```",
                 "def square(x):\n  return x + x\n",  # 2 + 2 == 4 only.
                 SQUARE, SQUARE]
  tests = [SQUARE_TESTS, SQUARE_TESTS, None, "assert square(4) == 16"]
  assert reward(["p"] * 4, completions, tests=tests, answer=[1] * 4) == [
      pytest.approx(2 / 3), pytest.approx(1 / 3), None, 1.0]
  all_or_nothing = ce.make_code_reward(scoring="all", timeout_s=20)
  assert all_or_nothing(["p"] * 2, [SQUARE] * 2,
                        tests=[SQUARE_TESTS[:2], SQUARE_TESTS]) == [1.0, 0.0]


def test_code_that_raises_passes_nothing_and_says_why():
  run = ce.run_tests("import no_such_module_xyz\n" + SQUARE,
                     SQUARE_TESTS[:2], timeout_s=20)
  assert run.tests_passed == [False, False]
  assert run.code_error == ("ModuleNotFoundError: No module named "
                            "'no_such_module_xyz'")


def test_printing_or_exiting_early_fakes_no_pass():
  code = ("import os, sys, json\n"
          "print(json.dumps(['token', 'pass', 0]))\n"
          "os._exit(0)\n")
  run = ce.run_tests(code, ["assert True"], timeout_s=20)
  assert run.tests_passed == [False] and run.returncode == 0


def test_an_infinite_loop_is_killed_at_the_time_limit():
  run = ce.run_tests(SQUARE, ["assert square(2) == 4", "while True:\n  pass",
                              "assert True"], timeout_s=1)
  assert run.timed_out
  assert run.returncode == -9  # SIGKILL
  # Tests reported before the limit keep their result; the rest fail.
  assert run.tests_passed == [True, False, False]


def test_a_memory_bomb_stops_at_the_memory_limit():
  code = "block = bytearray(400 * 2**20)\nfill = block.find(1)\n"
  limited = ce.run_tests(code, ["assert fill == -1"], memory_mb=128,
                         timeout_s=20)
  assert limited.code_error == "MemoryError"
  assert limited.tests_passed == [False]
  # The same code passes when the limit leaves room: the limit stopped it.
  roomy = ce.run_tests(code, ["assert fill == -1"], memory_mb=1024,
                       timeout_s=20)
  assert roomy.code_error is None and roomy.tests_passed == [True]


@pytest.mark.parametrize("network", PROTECTIONS)
def test_sockets_cannot_reach_a_server_on_this_machine(network):
  server = socket.create_server(("127.0.0.1", 0))
  server.settimeout(0.2)
  port = server.getsockname()[1]
  try:
    code = (f"import socket\n"
            f"def talk():\n"
            f"  with socket.create_connection(('127.0.0.1', {port}), "
            f"timeout=2) as s:\n"
            f"    s.sendall(b'hi')\n"
            f"  return True\n")
    run = ce.run_tests(code, ["assert talk()"], network=network,
                       timeout_s=20)
    assert run.network == network
    assert run.tests_passed == [False]
    with pytest.raises(socket.timeout):
      server.accept()  # Nothing connected.
    if network in ("namespace", "bubblewrap"):
      # A program the code starts (without our audit hook) is cut off too.
      child = (f"import socket; socket.create_connection(('127.0.0.1', "
               f"{port}), timeout=2)")
      code = ("import subprocess, sys\n"
              f"done = subprocess.run([sys.executable, '-c', {child!r}])\n")
      run = ce.run_tests(code, ["assert done.returncode == 0"],
                         network=network, timeout_s=20)
      assert run.code_error is None and run.tests_passed == [False]
      with pytest.raises(socket.timeout):
        server.accept()
    else:
      run = ce.run_tests("import subprocess\nsubprocess.run(['true'])\n",
                         ["pass"], network=network, timeout_s=20)
      assert run.code_error.startswith("PermissionError: refused by the code "
                                       "reward's sandbox: subprocess.Popen")
    # The server itself is reachable from here: the sandbox refused.
    with socket.create_connection(("127.0.0.1", port), timeout=2):
      connection, _ = server.accept()
      connection.close()
  finally:
    server.close()


def test_files_stay_in_a_scratch_directory_that_is_removed(tmp_path,
                                                          monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("JAXRLHF_TEST_SECRET", "hunter2")
  code = ("import os\n"
          "open('out.txt', 'w').write('x')\n"
          "os.makedirs('locked/deep')\n"
          "os.chmod('locked', 0)\n"  # Removal must still work.
          "print(os.getcwd())\n")
  run = ce.run_tests(code, ["assert open('out.txt').read() == 'x'",
                            "assert os.environ['HOME'] == os.getcwd()",
                            "assert 'JAXRLHF_TEST_SECRET' not in os.environ"],
                     timeout_s=20)
  assert run.tests_passed == [True, True, True]
  scratch = run.output.strip()
  assert scratch and scratch != str(tmp_path)
  assert not os.path.exists(scratch)
  assert not (tmp_path / "out.txt").exists()


def _state(pid: int):
  """The process's state letter, or None when it is gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0]
  except FileNotFoundError:
    return None


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_a_child_that_outlives_the_code_is_killed(tmp_path):
  marker = tmp_path / "child_ran_on"
  code = ("import os, time, json\n"
          "pid = os.fork()\n"
          "if pid == 0:\n"
          "  time.sleep(30)\n"
          f"  open({str(marker)!r}, 'w').write('still alive')\n"
          "  os._exit(0)\n"
          "print(json.dumps(pid), flush=True)\n")
  # (Without bubblewrap, whose process-id namespace would hide the child's
  # pid from us: test_bubblewrap_keeps_the_code_in_its_scratch_directory.)
  network = "namespace" if ce.namespace_available() else "audit_hook"
  run = ce.run_tests(code, ["assert True"], timeout_s=20, network=network)
  assert run.tests_passed == [True] and not run.timed_out
  child = json.loads(run.output)
  # SIGKILL went to the whole group when the run ended; the child is gone
  # (or a zombie waiting for its new parent to reap it) within moments.
  for _ in range(100):
    if _state(child) in (None, "Z", "X"):
      break
    time.sleep(0.05)
  assert _state(child) in (None, "Z", "X")
  assert not marker.exists()


def test_arguments_are_checked():
  with pytest.raises(ValueError, match=r"language='rust' is not supported"):
    ce.make_code_reward(language="rust")
  with pytest.raises(ValueError, match=r"scoring='half' is not supported"):
    ce.make_code_reward(scoring="half")
  with pytest.raises(ValueError, match=r"memory_mb=8 must be a whole number "
                     r">= 64"):
    ce.run_tests("", [], memory_mb=8)
  reward = ce.make_code_reward()
  with pytest.raises(ValueError, match=r"no column 'tests' \(their columns: "
                     r"\['answer'\]\); set tests_column"):
    reward(["p"], ["x"], answer=["1"])
  with pytest.raises(ValueError, match=r"row 0: column 'tests' holds int"):
    reward(["p"], ["x"], tests=[3])
  assert sys.platform != "win32"


@pytest.mark.skipif(not ce.bubblewrap_available(),
                    reason="bubblewrap (bwrap) does not run here")
def test_bubblewrap_keeps_the_code_in_its_scratch_directory(tmp_path):
  """Under bubblewrap the code writes only in its scratch directory, sees
  none of our processes, and 'auto' takes it."""
  outside = tmp_path / "outside.txt"
  code = (f"open({str(outside)!r}, 'w').write('x')\n")
  run = ce.run_tests(code, ["assert True"], network="bubblewrap",
                     timeout_s=20)
  assert run.code_error.startswith("OSError") or run.code_error.startswith(
      "FileNotFoundError") or "Read-only" in run.code_error
  assert not outside.exists()
  ours = str(os.getpid())
  run = ce.run_tests("import os\npids = [p for p in os.listdir('/proc') "
                     "if p.isdigit()]\n", [f"assert {ours!r} not in pids",
                                             "assert len(pids) < 5"],
                     network="bubblewrap", timeout_s=20)
  assert run.tests_passed == [True, True], run.output
  assert ce.network_protection("auto") == "bubblewrap"
