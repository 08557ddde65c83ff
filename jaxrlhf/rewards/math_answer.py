"""Math answers: extracting the final answer, and a reward for a right one.

`extract_answer(text, style)` finds a text's final answer (styles "boxed",
"gsm8k", "auto", "regex"; `jaxrlhf.answers`, where the data layouts read
answers too).

`make_math_answer_reward(answer_column, style, pattern)` makes a reward
function (the `jaxrlhf.rewards` convention): 1.0 when the completion's
extracted answer equals the row's reference answer symbolically, 0.0 when
it does not or no answer is found, None when the row has no reference.
Equality is `math-verify`'s (`verifier_process.answers_match`: `parse`
then `verify`, as TRL's examples use it): 0.5 = 1/2 = \\frac{1}{2},
1,000 = 1000, \\text{(B)} = B, x=3 = 3.
The reference is read by `reference_answer`: the last `\\boxed{}` of a MATH
solution, the number after `####` of a GSM8K answer, else the whole text
(an answer column that holds just "72" or "\\frac{1}{2}").
`math_answer_reward` is the one for column "answer" and style "auto".

Timeouts. The reward function compares in a process of its own
(`verifier_process`, which holds the equality, `answers_match`), in that
process's main thread, where math-verify's own limit works, and waits for
each row a bounded time: a completion whose answer sympy would take hours
to evaluate (or that holds the interpreter's lock in one C call, as
"\\boxed{10^{10^{10}}}" does) scores 0, as math-verify's own timeout
scores it, and the run goes on.
"""

import functools
import numbers
from typing import Callable, List, Optional, Sequence

from jaxrlhf import answers
from jaxrlhf import checks
from jaxrlhf import console
from jaxrlhf.rewards import verifier_process

# The extraction is `jaxrlhf.answers`' (one reading of answers for the data
# layouts and the rewards); re-exported here with the reward.
STYLES = answers.STYLES
extract_answer = answers.extract_answer
reference_answer = answers.reference_answer
last_boxed = answers.last_boxed
gsm8k_answer = answers.gsm8k_answer


@functools.lru_cache(maxsize=None)
def _verifier(verify_timeout_s: int) -> verifier_process.VerifierProcess:
  """One verifier process per limit, shared by the reward functions (its
  child starts at the first comparison)."""
  return verifier_process.VerifierProcess(verify_timeout_s)


def _reference_text(value, row: int, column: str) -> Optional[str]:
  if value is None:
    return None
  if isinstance(value, str):
    return value
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    return str(value)
  raise ValueError(f"math answer reward: row {row}: column {column!r} holds "
                   f"a {type(value).__name__} ({value!r}); a reference "
                   "answer is text or a number.")


def make_math_answer_reward(answer_column: str = "answer",
                            style: str = "auto",
                            pattern: Optional[str] = None, *,
                            verify_timeout_s: int = 5) -> Callable:
  """A reward function: 1.0 when a completion's final answer (extracted in
  `style`, or with `pattern`'s group) equals the row's reference in column
  `answer_column` (read by `reference_answer`), 0.0 otherwise, None for
  rows without a reference (None or empty).

  Args:
    answer_column: the column of reference answers.
    style: how a completion's answer is found (`STYLES`); "regex" when a
      pattern is given.
    pattern: a regex with one group around the answer.
    verify_timeout_s: math-verify's own limit per parse or comparison (in
      the verifier process; a row waits at most three of them and 5 s
      more: module docstring).
  """
  where = "make_math_answer_reward"
  if pattern is not None:
    answers.compile_pattern(pattern, where)
    if style == "auto":
      style = "regex"
  checks.check_choice(where, "style", style, STYLES)
  if style == "regex" and pattern is None:
    raise ValueError(f"{where}: style='regex' needs a pattern with one "
                     "group.")
  if not (isinstance(answer_column, str) and answer_column.isidentifier()):
    raise ValueError(f"{where}: answer_column={answer_column!r} must be a "
                     "column name (a Python identifier).")

  verifier = _verifier(int(verify_timeout_s))

  def math_answer_reward(prompts: Sequence[str], completions: Sequence[str],
                         **columns) -> List[Optional[float]]:
    del prompts  # The answer alone decides.
    if answer_column not in columns:
      raise ValueError(
          f"math answer reward: the rows have no column {answer_column!r} "
          f"(their columns: {sorted(columns)}); set answer_column to the "
          "column that holds the reference answers.")
    references = columns[answer_column]
    keys = []  # (answer, reference) per row; None: no comparison.
    scores = []
    for row, (completion, value) in enumerate(zip(completions, references)):
      reference = _reference_text(value, row, answer_column)
      gold = reference_answer(reference) if reference is not None else None
      answer = None if gold is None else extract_answer(
          completion, style, pattern if style == "regex" else None)
      scores.append(None if gold is None else 0.0)
      keys.append(None if answer is None else (answer, gold))
    # The samples of one prompt share its reference: each distinct pair is
    # compared once.
    distinct = sorted({k for k in keys if k is not None})
    if distinct:
      equal, timed_out = verifier.compare(distinct)
      if timed_out:
        console.log(
            f"Math answer reward: {timed_out} comparison(s) took longer "
            f"than {verifier.row_limit_s:g} s and score as wrong answers "
            "(the verifier process was restarted).")
      matches = dict(zip(distinct, equal))
      scores = [score if key is None else float(matches[key])
                for score, key in zip(scores, keys)]
    return scores

  return math_answer_reward


_DEFAULT_REWARD = make_math_answer_reward()


def math_answer_reward(prompts: Sequence[str], completions: Sequence[str],
                       answer: Sequence, **unused) -> List[Optional[float]]:
  """`make_math_answer_reward()`: the reference in column "answer", the
  completion's answer found in style "auto"."""
  del unused
  return _DEFAULT_REWARD(prompts, completions, answer=answer)
