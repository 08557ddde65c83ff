"""Math answers: extraction by style and the math-verify reward, checked
against what the math is (1/2 = 0.5, sqrt(4) = 2, (x+1)^2 = x^2+2x+1)."""

import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import REPO, quiet_env
from jaxrlhf.rewards import host
from jaxrlhf.rewards import math_answer
from jaxrlhf.rewards import verifier_process

extract = math_answer.extract_answer


@pytest.mark.parametrize("text,style,expected", [
    # boxed: the last one, nested braces kept.
    (r"so $x = \boxed{\frac{1}{2}}$.", "boxed", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{ \sqrt{a^{2}} }", "boxed", r"\sqrt{a^{2}}"),
    (r"\fbox{7}", "boxed", "7"),
    (r"\boxed{unclosed", "boxed", None),
    ("the answer is 5", "boxed", None),
    # gsm8k: the number after the last ####, commas and $ dropped.
    ("48/2 = <<48/2=24>>24\n#### 1,200", "gsm8k", "1200"),
    ("#### $18.50", "gsm8k", "18.50"),
    ("#### -3\n", "gsm8k", "-3"),
    ("#### 4 then #### 5", "gsm8k", "5"),
    ("#### four", "gsm8k", None),
    ("no marker 12", "gsm8k", None),
    # auto: boxed, else ####, else the last number.
    (r"#### 3 and \boxed{4}", "auto", "4"),
    ("working 12 #### 3", "auto", "3"),
    ("it is 1,000 or -7.5 apples", "auto", "-7.5"),
    ("pages 3-4", "auto", "4"),
    ("no number", "auto", None),
])
def test_extract_answer(text, style, expected):
  assert extract(text, style) == expected


def test_extract_answer_with_a_pattern():
  text = "Answer: 12\nAnswer: x+1\n"
  assert extract(text, "regex", pattern=r"Answer: (\S+)") == "x+1"
  assert extract("nothing", "regex", pattern=r"Answer: (\S+)") is None
  with pytest.raises(ValueError, match=r"has 2 groups; it needs exactly one"):
    extract(text, "regex", pattern=r"(A)(n)")
  with pytest.raises(ValueError, match=r"not a valid regular expression"):
    extract(text, "regex", pattern=r"(")
  with pytest.raises(ValueError, match=r"style='boxd' is not supported"):
    extract(text, "boxd")


@pytest.mark.parametrize("reference,expected", [
    (r"Add them: $1+1 = \boxed{2}$.", "2"),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"),
    (r"\frac{1}{2}", r"\frac{1}{2}"),  # A bare answer is used whole.
    (" 1000 ", "1000"),
    ("  ", None),
])
def test_reference_answer(reference, expected):
  assert math_answer.reference_answer(reference) == expected


# (completion, reference, reward): equal as math or not.
CASES = [
    (r"The answer is $\boxed{0.5}$.", r"\frac{1}{2}", 1.0),
    (r"So \boxed{\frac{2}{4}}", "0.5", 1.0),
    (r"\boxed{1/2}", r"\dfrac{1}{2}", 1.0),
    ("She has 1,000 left.\n#### 1,000", "1000", 1.0),
    ("#### 1000", r"Thus $\boxed{1{,}000}$", 1.0),
    (r"\boxed{\sqrt{4}}", "2", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 1.0),
    ("#### 42", 42, 1.0),
    (r"\boxed{2}", "3", 0.0),
    (r"\boxed{1/3}", "0.34", 0.0),
    (r"\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("#### -5", "5", 0.0),
    ("I am not sure.", "3", 0.0),
    (r"\boxed{5}", None, None),
    (r"\boxed{5}", "", None),
]


def test_math_answer_reward_against_the_math():
  completions = [c for c, _, _ in CASES]
  answers = [a for _, a, _ in CASES]
  rewards = math_answer.math_answer_reward(["p"] * len(CASES), completions,
                                           answer=answers, other=[0] * 16)
  assert rewards == [r for _, _, r in CASES]


def test_reward_styles_and_columns():
  # Style "boxed" ignores an unboxed answer; "gsm8k" a boxed one.
  boxed = math_answer.make_math_answer_reward(style="boxed")
  gsm8k = math_answer.make_math_answer_reward("final", style="gsm8k")
  texts = ["the answer is 5", r"\boxed{5}", "#### 5"]
  assert boxed(["p"] * 3, texts, answer=["5"] * 3) == [0.0, 1.0, 0.0]
  assert gsm8k(["p"] * 3, texts, final=["5"] * 3) == [0.0, 0.0, 1.0]
  regex = math_answer.make_math_answer_reward(pattern=r"ANSWER=(\S+)")
  assert regex(["p"] * 2, ["ANSWER=1/2", "0.5"], answer=["0.5"] * 2) == [
      1.0, 0.0]
  with pytest.raises(ValueError, match=r"no column 'answer' \(their columns: "
                     r"\['solution'\]\); set answer_column"):
    boxed(["p"], ["x"], solution=["1"])
  with pytest.raises(ValueError, match=r"row 0: column 'answer' holds a list"):
    boxed(["p"], ["x"], answer=[["1"]])
  with pytest.raises(ValueError, match=r"style='regex' needs a pattern"):
    math_answer.make_math_answer_reward(style="regex")
  with pytest.raises(ValueError, match=r"answer_column='my answer'"):
    math_answer.make_math_answer_reward("my answer")


def test_math_verify_timeout_needs_the_main_thread_and_is_turned_off_elsewhere():
  # The library's own limit (signal.alarm) fails outside the main thread...
  mv = verifier_process.load_math_verify()
  errors = []

  def parse_with_alarm():
    try:
      mv.parse("$1$", parsing_timeout=5)
    except ValueError as e:
      errors.append(str(e))

  thread = threading.Thread(target=parse_with_alarm)
  thread.start()
  thread.join()
  assert errors and "threaded environment" in errors[0]
  # ...so the reward compares in a process of its own, in that process's
  # main thread (verifier_process): in host.score's worker thread it gives
  # the same rewards as in the main thread.
  completions = [c for c, _, _ in CASES]
  answers = [a for _, a, _ in CASES]
  direct = math_answer.math_answer_reward(["p"] * len(CASES), completions,
                                          answer=answers)
  scored = host.score(math_answer.math_answer_reward, "math",
                      ["p"] * len(CASES), completions, {"answer": answers},
                      timeout_s=60)
  assert scored.skipped == {}
  assert [None if v != v else float(v) for v in scored.values] == direct


def test_an_answer_sympy_cannot_finish_scores_0_and_the_run_goes_on():
  """\\boxed{10^{10^{10}}} asks sympy for a ten-billion-digit integer. In a
  worker thread (host.score's), where math-verify's own limit is off, that
  computation holds the interpreter's lock: the whole process stopped,
  host.score's time limit included. The reward compares in its verifier
  process, whose main thread keeps math-verify's limit: that row scores 0
  after about verify_timeout_s, the others as they should. In a subprocess,
  so that a regression fails the test instead of hanging the suite."""
  code = textwrap.dedent(r"""
      from jaxrlhf.rewards import host, math_answer
      reward = math_answer.make_math_answer_reward(verify_timeout_s=1)
      scored = host.score(
          reward, "math", ["p"] * 3,
          [r"\boxed{5}", r"\boxed{10^{10^{10}}}", r"\boxed{\frac{10}{2}}"],
          {"answer": ["5"] * 3}, timeout_s=60)
      print(scored.values.tolist(), scored.skipped)
  """)
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=quiet_env())
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines()[-1] == "[1.0, 0.0, 1.0] {}", (
      result.stdout)


def test_a_row_over_its_limit_is_wrong_and_a_fresh_verifier_answers_the_rest():
  """The parent's own limit, for a comparison math-verify does not end: the
  child is killed on that row, which counts as a wrong answer, and a new
  child compares the rows after it."""
  verifier = verifier_process.VerifierProcess(verify_timeout_s=60,
                                              row_limit_s=1)
  try:
    equal, timed_out = verifier.compare([
        ("5", "5"), ("10^{10^{10}}", "5"), ("\\frac{10}{2}", "5"),
        ("6", "5")])
    # The fresh child runs with its address space bounded (a value sympy
    # would build in memory fails there, not in the host's memory).
    limits = open(f"/proc/{verifier._child.pid}/limits").read()  # pylint: disable=protected-access
  finally:
    verifier.close()
  assert (equal, timed_out) == ([True, False, True, False], 1)
  address_space = next(line for line in limits.splitlines()
                       if line.startswith("Max address space"))
  assert address_space.split()[3] == str(
      verifier_process._MEMORY_LIMIT_BYTES), address_space  # pylint: disable=protected-access


def test_a_verifier_that_cannot_start_is_named(monkeypatch):
  """A child that exits as it starts stops the reward with a line that says
  so and what to run, instead of a wait."""
  monkeypatch.setattr(verifier_process.sys, "executable", "/bin/false")
  verifier = verifier_process.VerifierProcess(verify_timeout_s=1)
  with pytest.raises(RuntimeError, match=r"the verifier process \(python -m "
                     r"jaxrlhf.rewards.verifier_process\) exited with status "
                     r"1 as it started; run that command"):
    verifier.compare([("1", "1")])
