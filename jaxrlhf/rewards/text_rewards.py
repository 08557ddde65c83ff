"""Small built-in reward functions of a completion's text (the
`jaxrlhf.rewards` convention): a format reward by regular expression, and
a length-in-characters bound."""

import re
from typing import Callable, List, Optional, Sequence

from jaxrlhf import checks

MATCH_MODES = ("search", "full")


def make_regex_reward(pattern: str, *, match: str = "search",
                      flags: int = re.DOTALL) -> Callable:
  """1.0 for a completion the pattern matches, else 0.0.

  E.g. `make_regex_reward(r"<think>.*?</think>\\s*\\S.*", match="full")`
  (reasoning in tags, then an answer) or `make_regex_reward(r"#### -?\\d+")`.

  Args:
    pattern: a Python regular expression.
    match: "search" (anywhere in the completion) or "full" (the whole
      completion).
    flags: `re` flags; DOTALL by default, so "." crosses lines.
  """
  checks.check_choice("make_regex_reward", "match", match, MATCH_MODES)
  try:
    compiled = re.compile(pattern, flags)
  except re.error as e:
    raise ValueError(f"make_regex_reward: pattern {pattern!r} is not a valid "
                     f"regular expression ({e}).") from None
  test = compiled.fullmatch if match == "full" else compiled.search

  def regex_reward(prompts: Sequence[str], completions: Sequence[str],
                   **unused) -> List[float]:
    del prompts, unused
    return [1.0 if test(text) else 0.0 for text in completions]

  return regex_reward


def make_length_reward(min_chars: Optional[int] = None,
                       max_chars: Optional[int] = None) -> Callable:
  """1.0 for a completion of min_chars..max_chars characters (either bound
  may be None: open), after stripping surrounding whitespace; else 0.0."""
  where = "make_length_reward"
  for name, value in (("min_chars", min_chars), ("max_chars", max_chars)):
    if value is not None and (isinstance(value, bool)
                              or not isinstance(value, int) or value < 0):
      raise ValueError(f"{where}: {name}={value!r} must be a whole number "
                       ">= 0, or None.")
  if min_chars is None and max_chars is None:
    raise ValueError(f"{where}: give min_chars, max_chars or both.")
  if None not in (min_chars, max_chars) and min_chars > max_chars:
    raise ValueError(f"{where}: min_chars={min_chars} is more than "
                     f"max_chars={max_chars}.")
  low = 0 if min_chars is None else min_chars
  high = float("inf") if max_chars is None else max_chars

  def length_reward(prompts: Sequence[str], completions: Sequence[str],
                    **unused) -> List[float]:
    del prompts, unused
    return [1.0 if low <= len(text.strip()) <= high else 0.0
            for text in completions]

  return length_reward
