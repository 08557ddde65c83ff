"""Math answers: extraction by style and the math-verify reward, checked
against what the math is (1/2 = 0.5, sqrt(4) = 2, (x+1)^2 = x^2+2x+1)."""

import threading

import pytest

from jaxrlhf.rewards import host
from jaxrlhf.rewards import math_answer

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
  mv = math_answer._math_verify()
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
  # ...so the reward turns it off there: in host.score's worker thread it
  # gives the same rewards as in the main thread.
  completions = [c for c, _, _ in CASES]
  answers = [a for _, a, _ in CASES]
  direct = math_answer.math_answer_reward(["p"] * len(CASES), completions,
                                          answer=answers)
  scored = host.score(math_answer.math_answer_reward, "math",
                      ["p"] * len(CASES), completions, {"answer": answers},
                      timeout_s=60)
  assert scored.skipped == {}
  assert [None if v != v else float(v) for v in scored.values] == direct
