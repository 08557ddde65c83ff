"""Reward functions on the host: loading them by name, calling them guarded.

`load_function("package.module:function", field)` imports a reward function
named in a config. `score(fn, name, prompts, completions, columns, ...)`
calls one under the convention of `jaxrlhf.rewards` and checks what comes
back: every failure is a one-line message that names the function, the row
(its index and the start of its prompt and completion) and the reason:

| reason         | what happened                                             |
| -------------- | --------------------------------------------------------- |
| `raised`       | the function raised (type and first line of the message)  |
| `wrong_count`  | it returned something that is not one value per row       |
| `non_finite`   | a value is NaN or infinite                                |
| `not_a_number` | a value is not a number or None: a string (even "0.4"), a |
|                | bool, a list, ...                                         |
| `timeout`      | the call took longer than `timeout_s`                     |

`on_bad_row="raise"` raises `RewardFunctionError` with the first such
message. `on_bad_row="skip_and_report"` scores the bad rows NaN, like rows
the reward does not apply to (None), and counts them by reason
(`HostScores.skipped`), keeping their messages. When the whole call raises,
the rows are scored again one at a time to find the bad ones (within a
second `timeout_s` for all of them together: rows not reached in time count
as `timeout`). When the whole call times out, all its rows count as
`timeout`: calling a slow function row by row would take longer still.
A function that returns the wrong number of values is wrong for every row,
so all the call's rows count as `wrong_count`.

The time limit. A Python function cannot be stopped from outside once it
runs in a thread, and a signal alarm (what `math-verify` uses) only works in
the main thread, which the trainer needs. So each call runs in a fresh
daemon thread that the caller waits for at most `timeout_s` seconds (the
whole call, not per row). On timeout the thread is abandoned: the function
keeps running in the background until it returns by itself (its result is
then dropped), holding whatever it holds, and a daemon thread does not keep
the process from exiting. A function that can hang for good (an infinite
loop, a blocked socket) therefore leaks a thread per timed-out call:
give such code a time limit of its own, or run it in a subprocess as
`code_execution` does. `timeout_s=None` calls the function in the caller's
thread with no limit.
"""

import dataclasses
import importlib
import math
import numbers
import threading
import time
from typing import (Any, Callable, Dict, List, Mapping, Optional, Sequence,
                    Tuple)

import numpy as np

from jaxrlhf import checks
from jaxrlhf.data import alignment_kinds

ON_BAD_ROW = ("raise", "skip_and_report")
RAISED = "raised"
WRONG_COUNT = "wrong_count"
NON_FINITE = "non_finite"
NOT_A_NUMBER = "not_a_number"
TIMEOUT = "timeout"
REASONS = (RAISED, WRONG_COUNT, NON_FINITE, NOT_A_NUMBER, TIMEOUT)
# How many skipped rows' messages a HostScores keeps (all are counted).
MAX_MESSAGES = 20
_PREVIEW_CHARS = 40

RewardFunction = Callable[..., Sequence[Optional[float]]]


class RewardFunctionError(ValueError):
  """A reward function failed on a row; the message is one line."""


@dataclasses.dataclass
class HostScores:
  """What one reward function gave for a batch of rows.

  Attributes:
    values: [num_rows] float32; NaN where the reward does not apply (the
      function returned None) or the row was skipped.
    num_not_applicable: rows the function returned None for.
    skipped: rows skipped by reason (`REASONS`); empty when none were.
    messages: the one-line messages of the first `MAX_MESSAGES` skipped
      rows.
    seconds: wall-clock time of the call(s).
  """
  values: np.ndarray
  num_not_applicable: int = 0
  skipped: Dict[str, int] = dataclasses.field(default_factory=dict)
  messages: List[str] = dataclasses.field(default_factory=list)
  seconds: float = 0.0

  @property
  def num_skipped(self) -> int:
    return sum(self.skipped.values())


# --- loading -----------------------------------------------------------------


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return lines[0] if lines else ""


def load_function(import_path: str, field: str) -> Callable:
  """The callable named "package.module:function" ("module:Class.method"
  follows the dots); a one-line ValueError naming `field` when it cannot
  be imported, is missing, or is not callable."""
  if not isinstance(import_path, str) or import_path.count(":") != 1:
    raise ValueError(f"{field}: {import_path!r} is not 'package.module:"
                     "function'; name the module, a colon, then the "
                     "function, e.g. 'my_rewards:format_reward'.")
  module_name, attribute = (part.strip() for part in import_path.split(":"))
  if not module_name or not attribute:
    raise ValueError(f"{field}: {import_path!r} is not 'package.module:"
                     "function'; both the module and the function must be "
                     "named.")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except
    detail = f"{type(e).__name__}: {_first_line(e)}".rstrip(": ")
    raise ValueError(
        f"{field}: cannot import module {module_name!r} of {import_path!r} "
        f"({detail}); check the name, and that the module is importable "
        "(installed, or on PYTHONPATH).") from None
  value = module
  for part in attribute.split("."):
    if not hasattr(value, part):
      raise ValueError(f"{field}: module {module_name!r} has no attribute "
                       f"{attribute!r} ({import_path!r}); check the "
                       "function's name.")
    value = getattr(value, part)
  if not callable(value):
    raise ValueError(f"{field}: {import_path!r} is a "
                     f"{type(value).__name__}, not a function; name a "
                     "callable fn(prompts, completions, **columns).")
  return value


# --- calling -----------------------------------------------------------------


@dataclasses.dataclass
class _Outcome:
  value: Any = None
  error: Optional[BaseException] = None
  timed_out: bool = False


def _call(fn: RewardFunction, prompts: List[str], completions: List[str],
          columns: Mapping[str, list], timeout_s: Optional[float],
          name: str) -> _Outcome:
  """fn(prompts, completions, **columns) in a daemon thread waited for at
  most timeout_s seconds (module docstring)."""
  if timeout_s is None:
    try:
      return _Outcome(value=fn(prompts, completions, **columns))
    except Exception as e:  # pylint: disable=broad-except
      return _Outcome(error=e)
  outcome = _Outcome()

  def run():
    try:
      outcome.value = fn(prompts, completions, **columns)
    except BaseException as e:  # pylint: disable=broad-except
      outcome.error = e

  thread = threading.Thread(target=run, name=f"reward function {name}",
                            daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    return _Outcome(timed_out=True)  # Abandoned: it runs on, unheard.
  return outcome


def _preview(text) -> str:
  text = str(text)
  if len(text) > _PREVIEW_CHARS:
    return repr(text[:_PREVIEW_CHARS]) + "..."
  return repr(text)


def _as_value(value) -> Tuple[Optional[float], Optional[str], str]:
  """(the float, None, "") for a good value, (None, None, "") for None,
  (None, reason, what) for a bad one."""
  if value is None:
    return None, None, ""
  if isinstance(value, (bool, np.bool_)):
    return None, NOT_A_NUMBER, f"returned {value!r}, a bool, not a number"
  if isinstance(value, numbers.Real):
    number = float(value)
  elif (hasattr(value, "dtype") and np.ndim(value) == 0 and (
      np.issubdtype(value.dtype, np.integer)
      or np.issubdtype(value.dtype, np.floating))):
    number = float(value)  # A 0-d numpy or jax array.
  else:
    return None, NOT_A_NUMBER, (f"returned {_preview(value)} (a "
                                f"{type(value).__name__}), not a number or "
                                "None")
  if not math.isfinite(number):
    return None, NON_FINITE, f"returned {number}, not a finite number"
  return number, None, ""


def _values_of(result, num_rows: int) -> Optional[str]:
  """None when `result` holds one value per row, else what is wrong."""
  if isinstance(result, np.ndarray):
    if result.ndim == 1 and len(result) == num_rows:
      return None
    return (f"returned an array of shape {list(result.shape)} for "
            f"{num_rows} rows")
  if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
    return (f"returned a {type(result).__name__}, not a list of one value "
            f"per row ({num_rows})")
  if len(result) != num_rows:
    return f"returned {len(result)} values for {num_rows} rows"
  return None


class _Collector:
  """Values, counts and messages of one `score` call."""

  def __init__(self, name: str, prompts, completions, on_bad_row: str):
    self.name = name
    self.prompts = prompts
    self.completions = completions
    self.on_bad_row = on_bad_row
    self.values = np.full(len(prompts), np.nan, np.float32)
    self.not_applicable = 0
    self.skipped: Dict[str, int] = {}
    self.messages: List[str] = []

  def message(self, rows: Sequence[int], what: str) -> str:
    first = rows[0]
    which = (f"row {first} (" if len(rows) == 1
             else f"rows {first}-{rows[-1]} (first: ")
    advice = ("" if self.on_bad_row != "raise" else
              " Fix the function, or score with "
              "on_bad_row='skip_and_report' to leave such rows out and count "
              "them.")
    return (f"reward function {self.name!r}, {which}prompt "
            f"{_preview(self.prompts[first])}, completion "
            f"{_preview(self.completions[first])}): {what}.{advice}")

  def bad(self, rows: Sequence[int], reason: str, what: str) -> None:
    """Rows that cannot be scored: raise, or skip and count them."""
    if not len(rows):
      return
    message = self.message(rows, what)
    if self.on_bad_row == "raise":
      raise RewardFunctionError(message)
    self.skipped[reason] = self.skipped.get(reason, 0) + len(rows)
    if len(self.messages) < MAX_MESSAGES:
      self.messages.append(f"{reason}: {message}")

  def take(self, index: int, value) -> None:
    number, reason, what = _as_value(value)
    if reason is not None:
      self.bad([index], reason, what)
    elif number is None:
      self.not_applicable += 1
    else:
      self.values[index] = number


def _check_rows(prompts, completions, columns) -> Dict[str, list]:
  where = "rewards.host.score"
  if len(prompts) != len(completions):
    raise ValueError(f"{where}: {len(prompts)} prompts but "
                     f"{len(completions)} completions; give one completion "
                     "per row.")
  out = {}
  for column, values in (columns or {}).items():
    if column in alignment_kinds.RESERVED_COLUMN_NAMES:
      raise ValueError(f"{where}: a column may not be named {column!r}: "
                       "reward functions get the prompts and completions "
                       "under that name.")
    if len(values) != len(prompts):
      raise ValueError(f"{where}: column {column!r} has {len(values)} values "
                       f"for {len(prompts)} rows; give one per row.")
    out[column] = list(values)
  return out


def score(fn: RewardFunction, name: str, prompts: Sequence[str],
          completions: Sequence[str],
          columns: Optional[Mapping[str, Sequence[Any]]] = None, *,
          timeout_s: Optional[float], on_bad_row: str = "raise"
          ) -> HostScores:
  """fn(prompts, completions, **columns), checked row by row (module doc).

  Args:
    fn: a reward function under the `jaxrlhf.rewards` convention.
    name: how messages name it (e.g. its config entry or import path).
    prompts: [num_rows] prompt texts.
    completions: [num_rows] completion texts.
    columns: the rows' other fields, each a list of [num_rows] values,
      passed to `fn` as keyword arguments.
    timeout_s: the most seconds the whole call may take (None: no limit).
    on_bad_row: "raise" or "skip_and_report".

  Returns:
    HostScores with values [num_rows] float32.

  Raises:
    RewardFunctionError: on_bad_row is "raise" and a row failed.
  """
  checks.check_choice("rewards.host.score", "on_bad_row", on_bad_row,
                      ON_BAD_ROW)
  if timeout_s is not None and not timeout_s > 0:
    raise ValueError(f"rewards.host.score: timeout_s={timeout_s!r}; give a "
                     "positive number of seconds, or None for no limit.")
  prompts, completions = list(prompts), list(completions)
  columns = _check_rows(prompts, completions, columns)
  num_rows = len(prompts)
  start = time.perf_counter()
  out = _Collector(name, prompts, completions, on_bad_row)
  if num_rows:
    _score_call(fn, out, prompts, completions, columns, timeout_s)
  return HostScores(values=out.values, num_not_applicable=out.not_applicable,
                    skipped=out.skipped, messages=out.messages,
                    seconds=time.perf_counter() - start)


def _score_call(fn, out: _Collector, prompts, completions, columns,
                timeout_s) -> None:
  num_rows = len(prompts)
  all_rows = list(range(num_rows))
  outcome = _call(fn, prompts, completions, columns, timeout_s, out.name)
  if outcome.timed_out:
    out.bad(all_rows, TIMEOUT, f"the call on {num_rows} row(s) took longer "
            f"than timeout_s={timeout_s:g} s (it keeps running in a "
            "background thread)")
    return
  if outcome.error is None:
    wrong = _values_of(outcome.value, num_rows)
    if wrong is not None:
      out.bad(all_rows, WRONG_COUNT, wrong)
      return
    for index, value in enumerate(outcome.value):
      out.take(index, value)
    return
  if num_rows == 1:
    out.bad([0], RAISED, _raised(outcome.error))
    return
  # Find the rows that make the call raise by calling them one at a time,
  # all within one more timeout_s.
  deadline = None if timeout_s is None else time.perf_counter() + timeout_s
  any_bad = False
  for index in all_rows:
    left = None if deadline is None else deadline - time.perf_counter()
    if left is not None and left <= 0:
      out.bad(all_rows[index:], TIMEOUT, "not scored: calling the rows one "
              "by one, after the whole call raised "
              f"{type(outcome.error).__name__}, took longer than "
              f"timeout_s={timeout_s:g} s")
      return
    row = _call(fn, prompts[index:index + 1], completions[index:index + 1],
                {k: v[index:index + 1] for k, v in columns.items()}, left,
                out.name)
    if row.timed_out:
      out.bad(all_rows[index:], TIMEOUT, "took longer than the time left of "
              f"timeout_s={timeout_s:g} s when called alone, after the "
              f"whole call raised {type(outcome.error).__name__}")
      return
    if row.error is not None:
      any_bad = True
      out.bad([index], RAISED, _raised(row.error))
      continue
    wrong = _values_of(row.value, 1)
    if wrong is not None:
      any_bad = True
      out.bad([index], WRONG_COUNT, wrong + " (called alone)")
      continue
    out.take(index, row.value[0])
  if not any_bad:
    # Every row scores alone: the function fails on batches, not on a row.
    what = (_raised(outcome.error) + " on the whole call, though each row "
            "alone scores")
    if out.on_bad_row == "raise":
      out.bad(all_rows, RAISED, what)
    elif len(out.messages) < MAX_MESSAGES:
      out.messages.append(f"{RAISED} (rows kept, scored one by one): "
                          + out.message(all_rows, what))


def _raised(error: BaseException) -> str:
  line = _first_line(error)
  return f"raised {type(error).__name__}" + (f": {line}" if line else "")
