"""Checks that a row of alignment data gives a well-formed example.

Bad rows. A row that cannot give a well-formed example (invalid JSON, a
missing field, a value of the wrong type, an empty prompt or completion, a
non-finite or non-numeric reward/margin/score, a label that is not 0/1, a
prompt longer than `max_prompt_tokens` or a completion longer than
`max_completion_tokens` tokens (EOS included where the task appends one), too
few or too many ranked completions, ...) is never dropped silently: with
`on_bad_row="raise"` (default) the first one raises `BadRowError` naming the
file and row; with `on_bad_row="skip_and_report"` it is skipped, counted by
reason (`bad_row_counts(split)`), kept with its message (`bad_rows(split)`),
and a summary line is logged when the split is loaded.

Reasons: invalid_json, missing_field, wrong_type, empty_prompt,
empty_completion, non_finite_reward (any reward, margin, confidence or score
that is not a finite number, a numeric string such as "0.4" included),
bad_label, prompt_too_long, completion_too_long, too_few_completions, too_many_completions, and the
layouts' own: no_worse_completion, prompts_differ, unparsable_dialogue,
no_final_answer (a GSM8K answer without "#### <number>", a MATH solution
without \\boxed{}).
"""

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Union

from jaxrlhf.data import alignment_kinds as kinds_lib


class BadRowError(ValueError):
  """A malformed row, with its file and row number in the message."""


@dataclasses.dataclass(frozen=True)
class BadRow:
  """Why a row (or one completion of it) cannot give an example."""
  reason: str
  detail: str


@dataclasses.dataclass(frozen=True)
class BadRowRecord:
  path: str
  row: int
  reason: str
  detail: str

  def __str__(self):
    return f"{self.path}: row {self.row}: {self.reason}: {self.detail}"


def as_number(value, what: str) -> Union[float, BadRow]:
  """A finite number as a float; anything else (a boolean, a string even if
  it reads as a number, NaN, an infinity) is a bad row."""
  if value is None:
    return BadRow("missing_field", f"{what} is missing or null.")
  if isinstance(value, bool):
    return BadRow("non_finite_reward", f"{what} is a boolean ({value}), not "
                  "a number.")
  if isinstance(value, (str, bytes)):
    # A numeric column stored as text is a broken export, not a number.
    return BadRow("non_finite_reward", f"{what} is a string ({value!r}), not "
                  "a number; store it as a number.")
  try:
    number = float(value)
  except (TypeError, ValueError):
    return BadRow("non_finite_reward", f"{what} is not a number: {value!r}.")
  if not math.isfinite(number):
    return BadRow("non_finite_reward", f"{what} is not finite: {value!r}.")
  return number


def _check_text(value, field: str, empty_reason: str) -> Optional[BadRow]:
  if not isinstance(value, str):
    return BadRow("wrong_type", f"{field!r} must be a string, got "
                  f"{type(value).__name__}.")
  if not value.strip():
    return BadRow(empty_reason, f"{field!r} is empty.")
  return None


def _check_label(value) -> Union[float, BadRow]:
  if isinstance(value, bool):
    return float(value)
  if isinstance(value, (int, float)) and value in (0, 1):
    return float(value)
  return BadRow("bad_label", f"'label' must be true/false or 1/0, got "
                f"{value!r}.")


@dataclasses.dataclass(frozen=True)
class ExampleLimits:
  """Limits an example must meet; token counts include an appended EOS."""
  prompt_tokens: Optional[Callable[[str], int]] = None
  completion_tokens: Optional[Callable[[str], int]] = None
  max_prompt_tokens: Optional[int] = None
  max_completion_tokens: Optional[int] = None
  min_completions: int = 2
  max_completions: Optional[int] = None


def check_example(example: Mapping[str, Any], kind: kinds_lib.DataKind,
                  limits: ExampleLimits) -> Union[dict, BadRow]:
  """The example with scalars as floats and defaults filled, or a BadRow."""
  out = {}
  prompt = example.get(kinds_lib.PROMPT)
  if prompt is None:
    return BadRow("missing_field", "'prompt' is missing or null.")
  bad = _check_text(prompt, "prompt", "empty_prompt")
  if bad:
    return bad
  out["prompt"] = prompt
  completions_to_measure = []
  for field in kind.completion_fields:
    value = example.get(field)
    if value is None:
      return BadRow("missing_field", f"{field!r} is missing or null.")
    if kind.ranked:
      if not isinstance(value, (list, tuple)):
        return BadRow("wrong_type", f"{field!r} must be a list of strings.")
      for i, text in enumerate(value):
        bad = _check_text(text, f"{field}[{i}]", "empty_completion")
        if bad:
          return bad
      if len(value) < limits.min_completions:
        return BadRow("too_few_completions", f"{len(value)} completion(s); a "
                      f"ranking needs at least {limits.min_completions}.")
      if limits.max_completions and len(value) > limits.max_completions:
        return BadRow("too_many_completions", f"{len(value)} completions; at "
                      f"most {limits.max_completions} allowed.")
      out[field] = list(value)
      completions_to_measure.extend(
          (f"{field}[{i}]", text) for i, text in enumerate(value))
    else:
      bad = _check_text(value, field, "empty_completion")
      if bad:
        return bad
      out[field] = value
      completions_to_measure.append((field, value))
  for field, default in kind.scalar_defaults.items():
    value = example.get(field)
    if value is None:
      if default is None:
        return BadRow("missing_field", f"{field!r} is missing or null.")
      value = default
    number = (_check_label(value) if field == "label"
              else as_number(value, repr(field)))
    if isinstance(number, BadRow):
      return number
    out[field] = number
  if limits.max_prompt_tokens is not None and limits.prompt_tokens:
    count = limits.prompt_tokens(prompt)
    if count > limits.max_prompt_tokens:
      return BadRow("prompt_too_long", f"the prompt has {count} tokens; the "
                    f"limit is {limits.max_prompt_tokens}.")
  if limits.max_completion_tokens is not None and limits.completion_tokens:
    for field, text in completions_to_measure:
      count = limits.completion_tokens(text)
      if count > limits.max_completion_tokens:
        return BadRow("completion_too_long", f"{field!r} has {count} tokens "
                      f"(EOS included); the limit is "
                      f"{limits.max_completion_tokens}.")
  return out
