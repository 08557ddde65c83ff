"""Final answers in text: what a solution or a completion says its answer is.

`extract_answer(text, style)`:

* "boxed": the content of the last `\\boxed{...}` (or `\\fbox{...}`), nested
  braces included, as MATH solutions give it.
* "gsm8k": the number after the last `####`, as GSM8K answers end
  ("#### 1,200" gives "1200": thousands separators are dropped; a `$`
  before the number is allowed).
* "auto": "boxed", else "gsm8k", else the last number in the text.
* "regex": group 1 of the last match of a pattern with one group.

`reference_answer(text)` reads a reference the same way but takes a bare
answer ("72", "\\frac{1}{2}") whole. The data layouts (GSM8K, MATH), the
built-in arithmetic task and the math reward (`jaxrlhf.rewards.math_answer`)
all read answers here, so they agree on what an answer is. Pure text: no
math is parsed (that is the reward's `math-verify`).
"""

import functools
import re
from typing import Optional

from jaxrlhf import checks

STYLES = ("boxed", "gsm8k", "auto", "regex")

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number: thousands separated by commas or not, optional decimals; a minus
# sign only where it cannot be a hyphen or a subtraction ("3-4" gives 4).
_NUMBER = r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_GSM8K = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def last_boxed(text: str) -> Optional[str]:
  """The content of the last \\boxed{...} of `text` with its nested braces,
  stripped; None when there is none (or its braces never close)."""
  starts = [m.end() for m in _BOXED.finditer(text)]
  for start in reversed(starts):
    depth = 1
    for i in range(start, len(text)):
      if text[i] == "{":
        depth += 1
      elif text[i] == "}":
        depth -= 1
        if depth == 0:
          content = text[start:i].strip()
          if content:
            return content
          break
  return None


def _plain_number(text: str) -> str:
  return text.replace(",", "")


def gsm8k_answer(text: str) -> Optional[str]:
  """The number after the last "####" (commas dropped), or None."""
  matches = _GSM8K.findall(text)
  return _plain_number(matches[-1]) if matches else None


def last_number(text: str) -> Optional[str]:
  matches = _ANY_NUMBER.findall(text)
  return _plain_number(matches[-1]) if matches else None


@functools.lru_cache(maxsize=64)
def compile_pattern(pattern: str, where: str) -> "re.Pattern[str]":
  """A regex with exactly one group, or a one-line error naming `where`."""
  try:
    compiled = re.compile(pattern, re.DOTALL)
  except re.error as e:
    raise ValueError(f"{where}: pattern {pattern!r} is not a valid regular "
                     f"expression ({e}).") from None
  if compiled.groups != 1:
    raise ValueError(f"{where}: pattern {pattern!r} has {compiled.groups} "
                     "groups; it needs exactly one, around the answer, e.g. "
                     "r'Answer: (\\S+)'.")
  return compiled


def extract_answer(text: str, style: str = "auto",
                   pattern: Optional[str] = None) -> Optional[str]:
  """The final answer of `text` in `style` (module docstring), or None."""
  checks.check_choice("extract_answer", "style", style, STYLES)
  if (style == "regex") != (pattern is not None):
    raise ValueError("extract_answer: give a pattern with style='regex', "
                     "and only then.")
  if style == "regex":
    matches = compile_pattern(pattern, "extract_answer").findall(text)
    answer = matches[-1].strip() if matches else ""
    return answer or None
  if style == "boxed":
    return last_boxed(text)
  if style == "gsm8k":
    return gsm8k_answer(text)
  for find in (last_boxed, gsm8k_answer, last_number):
    answer = find(text)
    if answer is not None:
      return answer
  return None


def reference_answer(reference: str) -> Optional[str]:
  """The answer a reference gives: its last \\boxed{} content, else the
  number after its "####", else its whole text (stripped); None if empty."""
  answer = last_boxed(reference)
  if answer is None:
    answer = gsm8k_answer(reference)
  if answer is None:
    answer = reference.strip() or None
  return answer
