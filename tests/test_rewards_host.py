"""Reward functions on the host: loading by name, and every way a call can
fail, raised as one line naming the function, the row and the reason, or
skipped and counted. Expected values are written out by hand."""

import re
import threading

import numpy as np
import pytest

from jaxrlhf.rewards import host
from jaxrlhf.rewards import math_answer

PROMPTS = ["what is one plus one?", "name a colour", "say hi"]
COMPLETIONS = ["two", "bad", "hi"]


def scores_by_length(prompts, completions, **unused):
  del prompts, unused
  return [float(len(c)) for c in completions]


def test_scores_are_float32_with_nan_where_the_reward_does_not_apply():
  def reward(prompts, completions, answer, weight, **unused):
    assert unused == {}
    return [None if a is None else w * float(c == a)
            for c, a, w in zip(completions, answer, weight)]
  result = host.score(reward, "match", PROMPTS, COMPLETIONS,
                      {"answer": ["two", None, "hello"],
                       "weight": [2, 1, 1]}, timeout_s=5)
  assert result.values.dtype == np.float32
  np.testing.assert_array_equal(result.values, [2.0, np.nan, 0.0])
  assert result.num_not_applicable == 1
  assert result.skipped == {} and result.num_skipped == 0
  # numpy scalars, 0-d arrays and an array of values are numbers too.
  result = host.score(lambda p, c, **k: np.array([1, 2, 3], np.int64),
                      "array", PROMPTS, COMPLETIONS, timeout_s=5)
  np.testing.assert_array_equal(result.values, [1, 2, 3])
  result = host.score(
      lambda p, c, **k: [np.float64(0.5), np.array(2.0), np.int32(-1)],
      "numpy", PROMPTS, COMPLETIONS, timeout_s=None)
  np.testing.assert_array_equal(result.values, [0.5, 2.0, -1.0])


def bad_on_row_1(value):
  """A reward function that gives `value` for the completion "bad"."""
  def reward(prompts, completions, **unused):
    return [value if c == "bad" else 1.0 for c in completions]
  return reward


def raises_on_bad(prompts, completions, **unused):
  out = []
  for c in completions:
    if c == "bad":
      raise ZeroDivisionError("division by zero\nsecond line")
    out.append(0.5)
  return out


BAD_VALUES = [
    (bad_on_row_1(float("nan")), "non_finite",
     r"returned nan, not a finite number"),
    (bad_on_row_1(float("inf")), "non_finite",
     r"returned inf, not a finite number"),
    (bad_on_row_1("0.4"), "not_a_number",
     r"returned '0.4' \(a str\), not a number or None"),
    (bad_on_row_1(True), "not_a_number", r"returned True, a bool, not a "
     "number"),
    (bad_on_row_1([1.0]), "not_a_number", r"returned '\[1.0\]' \(a list\)"),
    (raises_on_bad, "raised", r"raised ZeroDivisionError: division by zero\. "),
]


@pytest.mark.parametrize("fn,reason,what", BAD_VALUES)
def test_a_bad_row_raises_one_line_naming_function_row_and_reason(
    fn, reason, what):
  with pytest.raises(host.RewardFunctionError) as error:
    host.score(fn, "my_reward", PROMPTS, COMPLETIONS, timeout_s=5)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(
      "reward function 'my_reward', row 1 (prompt 'name a colour', "
      "completion 'bad'): ")
  assert re.search(what, message), message
  assert "on_bad_row='skip_and_report'" in message


@pytest.mark.parametrize("fn,reason,what", BAD_VALUES)
def test_a_bad_row_is_skipped_and_counted(fn, reason, what):
  del what
  result = host.score(fn, "my_reward", PROMPTS, COMPLETIONS,
                      timeout_s=5, on_bad_row="skip_and_report")
  expected_good = 0.5 if fn is raises_on_bad else 1.0
  np.testing.assert_array_equal(result.values,
                                [expected_good, np.nan, expected_good])
  assert result.skipped == {reason: 1}
  assert result.num_not_applicable == 0
  assert len(result.messages) == 1
  assert result.messages[0].startswith(f"{reason}: reward function "
                                       "'my_reward', row 1 ")
  # Already skipping: the message does not advise switching to it.
  assert "skip_and_report" not in result.messages[0]


def test_long_texts_are_cut_in_messages():
  prompt = "p" * 100
  with pytest.raises(host.RewardFunctionError,
                     match=r"row 0 \(prompt '" + "p" * 40 + r"'\.\.\., "
                     r"completion 'bad'\)"):
    host.score(raises_on_bad, "r", [prompt], ["bad"], timeout_s=5)


@pytest.mark.parametrize("returned,what", [
    ([1.0, 2.0], r"returned 2 values for 3 rows"),
    (1.0, r"returned a float, not a list of one value per row \(3\)"),
    ("abc", r"returned a str, not a list"),
    (np.zeros((3, 1)), r"returned an array of shape \[3, 1\] for 3 rows"),
])
def test_the_wrong_number_of_values_fails_every_row(returned, what):
  fn = lambda prompts, completions, **unused: returned
  with pytest.raises(host.RewardFunctionError,
                     match=r"^reward function 'count', rows 0-2 \(first: "
                     r"prompt 'what is one plus one\?', completion 'two'\): "
                     + what):
    host.score(fn, "count", PROMPTS, COMPLETIONS, timeout_s=5)
  result = host.score(fn, "count", PROMPTS, COMPLETIONS, timeout_s=5,
                      on_bad_row="skip_and_report")
  assert np.isnan(result.values).all()
  assert result.skipped == {"wrong_count": 3}


def test_a_call_over_the_time_limit_fails_all_its_rows():
  release = threading.Event()
  started = threading.Event()

  def hangs(prompts, completions, **unused):
    started.set()
    release.wait(60)
    return [1.0] * len(completions)

  try:
    with pytest.raises(host.RewardFunctionError,
                       match=r"^reward function 'slow', rows 0-2 \(first: .*"
                       r"took longer than timeout_s=0\.05 s \(it keeps "
                       r"running in a background thread\)"):
      host.score(hangs, "slow", PROMPTS, COMPLETIONS, timeout_s=0.05)
    result = host.score(hangs, "slow", PROMPTS, COMPLETIONS, timeout_s=0.05,
                        on_bad_row="skip_and_report")
    assert np.isnan(result.values).all()
    assert result.skipped == {"timeout": 3}
    assert started.is_set()
  finally:
    release.set()  # Let the abandoned threads finish.


def test_rows_of_a_call_that_raised_are_scored_one_by_one_in_the_time_left():
  release = threading.Event()

  def fails_on_batches_hangs_on_row_2(prompts, completions, **unused):
    if len(completions) > 1:
      raise RuntimeError("batch")
    if completions[0] == "hi":
      release.wait(60)
    return [float(len(completions[0]))]

  try:
    result = host.score(fails_on_batches_hangs_on_row_2, "f",
                        PROMPTS + ["x"], COMPLETIONS + ["four"],
                        timeout_s=0.2, on_bad_row="skip_and_report")
  finally:
    release.set()
  # Rows 0 and 1 scored alone; row 2 hung, so it and row 3 are timeouts.
  np.testing.assert_array_equal(result.values, [3.0, 3.0, np.nan, np.nan])
  assert result.skipped == {"timeout": 2}
  assert "rows 2-3" in result.messages[0]


def test_a_function_that_fails_only_on_batches_is_named_as_such():
  def batch_only(prompts, completions, **unused):
    if len(completions) > 1:
      raise MemoryError()
    return [1.0]

  with pytest.raises(host.RewardFunctionError,
                     match=r"rows 0-2 .*raised MemoryError on the whole "
                     r"call, though each row alone scores"):
    host.score(batch_only, "b", PROMPTS, COMPLETIONS, timeout_s=5)
  result = host.score(batch_only, "b", PROMPTS, COMPLETIONS, timeout_s=5,
                      on_bad_row="skip_and_report")
  np.testing.assert_array_equal(result.values, [1.0, 1.0, 1.0])
  assert result.skipped == {}
  assert "each row alone scores" in result.messages[0]


def test_bad_arguments_are_the_callers_errors():
  with pytest.raises(ValueError, match=r"3 prompts but 2 completions"):
    host.score(scores_by_length, "r", PROMPTS, COMPLETIONS[:2], timeout_s=1)
  with pytest.raises(ValueError, match=r"column 'answer' has 1 values for 3"):
    host.score(scores_by_length, "r", PROMPTS, COMPLETIONS,
               {"answer": ["x"]}, timeout_s=1)
  with pytest.raises(ValueError, match=r"may not be named 'prompts'"):
    host.score(scores_by_length, "r", PROMPTS, COMPLETIONS,
               {"prompts": PROMPTS}, timeout_s=1)
  with pytest.raises(ValueError, match=r"on_bad_row='skip'"):
    host.score(scores_by_length, "r", PROMPTS, COMPLETIONS, timeout_s=1,
               on_bad_row="skip")
  with pytest.raises(ValueError, match=r"timeout_s=0"):
    host.score(scores_by_length, "r", PROMPTS, COMPLETIONS, timeout_s=0)
  empty = host.score(scores_by_length, "r", [], [], timeout_s=1)
  assert empty.values.shape == (0,)


# --- load_function -----------------------------------------------------------


def test_load_function_by_import_path():
  fn = host.load_function("jaxrlhf.rewards.math_answer:math_answer_reward",
                          "online.reward_functions")
  assert fn is math_answer.math_answer_reward


@pytest.mark.parametrize("path,message", [
    ("jaxrlhf.rewards.math_answer", r"is not 'package.module:function'"),
    ("a:b:c", r"is not 'package.module:function'"),
    (":f", r"both the module and the function must be named"),
    ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz' .*"
     r"ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("jaxrlhf.rewards.math_answer:nope", r"module 'jaxrlhf.rewards."
     r"math_answer' has no attribute 'nope'"),
    ("jaxrlhf.rewards.host:ON_BAD_ROW", r"is a tuple, not a function"),
])
def test_load_function_errors_name_the_field(path, message):
  with pytest.raises(ValueError,
                     match=r"^online.reward_functions\[0\]: .*" + message):
    host.load_function(path, "online.reward_functions[0]")


def test_load_function_reports_a_module_that_fails_to_import(tmp_path,
                                                             monkeypatch):
  (tmp_path / "broken_rewards_mod.py").write_text(
      "raise RuntimeError('needs a GPU\\nmore')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ValueError, match=r"^f: cannot import module "
                     r"'broken_rewards_mod' .*\(RuntimeError: needs a GPU\)"):
    host.load_function("broken_rewards_mod:reward", "f")
