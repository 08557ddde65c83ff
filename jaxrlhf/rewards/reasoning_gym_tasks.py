"""reasoning-gym's procedural tasks: a prompts file, their scorer as a reward,
and a multi-turn environment.

reasoning-gym (`pip install reasoning-gym`; offline, no downloads) makes
tasks by name (`create_dataset("leg_counting", size=100, seed=0)`), each
entry {"question": str, "answer": str, "metadata": {...,
"source_dataset": name}}, and scores an answer text against an entry with
the dataset's own `score_answer(answer, entry) -> float in [0, 1]` (exact
match, partial credit or a checker, as the task defines it).

1. The prompts file (JSON lines, layout "columns"):

     python -m jaxrlhf.rewards.reasoning_gym_tasks --dataset=leg_counting \\
         --size=100 --seed=0 --out=rg.jsonl

   Each row: "prompt" (the question and `INSTRUCTION`), "answer" (the
   dataset's own answer, text) and `ENTRY_COLUMN`, a JSON string
   {"dataset", "config", "entry", "max_attempts"}: everything the scorer
   needs, so the reward needs no other column. Read it with
   `column_mapping='prompt=prompt,answer=answer,rg_entry=rg_entry'`.
   A row is written only if the dataset's own answer scores the same on
   the entry as read back from JSON as on the entry itself (a dataset whose
   metadata JSON would change is refused in one line).
2. The reward, `rewards.functions='jaxrlhf.rewards.reasoning_gym_tasks:
   score=1'`: the completion's last <answer>...</answer> (None without one,
   which the scorers score 0) scored by the row's dataset, built with the
   row's config; None for rows without `ENTRY_COLUMN`.
3. The environment, `online.environment='jaxrlhf.rewards.
   reasoning_gym_tasks:make_env'`: the prompt opens as the user's message;
   each answer is scored, and a full score (1) or the row's last attempt
   (`max_attempts`, `--max_attempts`) ends the episode with that score as
   its reward; otherwise the user says what the answer scored and asks
   again (reward 0). The episode's return is the last attempt's score
   (weighted by `online.turn_discount` ** attempts - 1).

reasoning-gym is imported when first used, not with this module.
"""

import argparse
import functools
import json
import re
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence

ENTRY_COLUMN = "rg_entry"
INSTRUCTION = "Give your final answer between <answer> and </answer>."
DEFAULT_MAX_ATTEMPTS = 3
# The last <answer>...</answer> of a text, its content stripped.
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _reasoning_gym():
  """The reasoning_gym package, or a one-line ImportError saying how to get
  it."""
  try:
    import reasoning_gym  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError("reasoning-gym is not installed: pip install "
                      "reasoning-gym") from None
  return reasoning_gym


def _dataset(name: str, config_json: str = "{}", size: Optional[int] = None,
             seed: Optional[int] = None):
  """The reasoning-gym dataset `name` with config fields `config_json` (a
  one-line ValueError for an unknown name or field)."""
  rg = _reasoning_gym()
  config = json.loads(config_json)
  if size is not None:
    config["size"] = size
  if seed is not None:
    config["seed"] = seed
  registered = rg.factory.DATASETS
  if name not in registered:
    examples = ", ".join(sorted(registered)[:5])
    raise ValueError(f"reasoning-gym has no dataset {name!r} ({len(registered)}"
                     f" registered, e.g. {examples}; reasoning_gym.factory."
                     "DATASETS lists them)")
  try:
    return rg.create_dataset(name, **config)
  except TypeError as e:
    raise ValueError(f"reasoning-gym dataset {name!r}: config {config} does "
                     f"not fit its config class ({e})") from None


@functools.lru_cache(maxsize=64)
def _scorer(name: str, config_json: str):
  """The dataset's `score_answer`, one instance per (name, config)."""
  return _dataset(name, config_json).score_answer


def extract_answer(text: str) -> Optional[str]:
  """The content of `text`'s last <answer>...</answer>, stripped; None
  without one."""
  found = _ANSWER.findall(text)
  return found[-1].strip() if found else None


def _parsed(value: str) -> Dict[str, Any]:
  if not isinstance(value, str):
    raise ValueError(f"column {ENTRY_COLUMN!r} holds a "
                     f"{type(value).__name__}; it is the JSON text "
                     "`python -m jaxrlhf.rewards.reasoning_gym_tasks` writes")
  return json.loads(value)


def score_text(answer: Optional[str], entry_json: str) -> float:
  """The row's dataset's score of `answer` (text or None) on the row's
  entry (`ENTRY_COLUMN`'s JSON)."""
  task = _parsed(entry_json)
  scorer = _scorer(task["dataset"], json.dumps(task.get("config", {}),
                                               sort_keys=True))
  return float(scorer(answer, task["entry"]))


def score(prompts: Sequence[str], completions: Sequence[str],
          rg_entry: Optional[Sequence[Optional[str]]] = None,
          **unused_columns) -> List[Optional[float]]:
  """The `jaxrlhf.rewards` reward: each completion's last <answer> scored
  by its row's reasoning-gym dataset, in [0, 1]; None for rows without an
  entry (or when the run has no `rg_entry` column)."""
  del prompts, unused_columns
  if rg_entry is None:
    return [None] * len(completions)
  return [None if not entry else score_text(extract_answer(text), entry)
          for text, entry in zip(completions, rg_entry)]


class ReasoningGymEnv:
  """One task, answered until right or out of attempts (module docstring,
  3)."""

  def __init__(self, row: Mapping[str, Any]):
    if not row.get(ENTRY_COLUMN):
      raise ValueError(f"the row has no {ENTRY_COLUMN!r} column; map it in "
                       "data.column_mapping ('...,rg_entry=rg_entry')")
    self._prompt = row["prompt"]
    self._entry = row[ENTRY_COLUMN]
    self.max_attempts = int(_parsed(self._entry).get(
        "max_attempts", DEFAULT_MAX_ATTEMPTS))
    self.attempts = 0

  def reset(self) -> List[Dict[str, str]]:
    self.attempts = 0
    return [{"role": "user", "content": self._prompt}]

  def step(self, message: Mapping[str, Any]):
    self.attempts += 1
    answer = extract_answer(message.get("content") or "")
    value = score_text(answer, self._entry)
    if value >= 1.0 or self.attempts >= self.max_attempts:
      return [], value, True
    if answer is None:
      feedback = f"No answer found. {INSTRUCTION}"
    else:
      feedback = (f"That answer scores {value:.2f} out of 1. Try again. "
                  f"{INSTRUCTION}")
    return [{"role": "user", "content": feedback}], 0.0, False


def make_env(row: Mapping[str, Any]) -> ReasoningGymEnv:
  """`online.environment`'s factory (module docstring, 3)."""
  return ReasoningGymEnv(row)


def rows(dataset: str, size: int, seed: int, config_json: str = "{}",
         max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> List[Dict[str, str]]:
  """The prompts file's rows for `size` entries of `dataset` (module
  docstring, 1)."""
  data = _dataset(dataset, config_json, size=size, seed=seed)
  config = json.loads(config_json)
  out = []
  for i in range(size):
    entry = data[i]
    try:
      text = json.dumps(entry)
    except TypeError as e:
      raise ValueError(f"reasoning-gym dataset {dataset!r}: entry {i} cannot "
                       f"be written as JSON ({e})") from None
    truth = entry["answer"]
    if data.score_answer(truth, json.loads(text)) != data.score_answer(
        truth, entry):
      raise ValueError(f"reasoning-gym dataset {dataset!r}: entry {i} scores "
                       "its own answer differently once read back from JSON; "
                       "its scorer needs metadata JSON cannot keep")
    out.append({
        "prompt": f"{entry['question'].rstrip()}\n\n{INSTRUCTION}",
        "answer": "" if truth is None else str(truth),
        ENTRY_COLUMN: json.dumps({"dataset": dataset, "config": config,
                                  "entry": json.loads(text),
                                  "max_attempts": max_attempts}),
    })
  return out


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(
      description="Write a reasoning-gym dataset as a jaxrlhf prompts file "
      "(JSON lines).")
  parser.add_argument("--dataset", required=True,
                      help="a reasoning-gym dataset name, e.g. leg_counting")
  parser.add_argument("--size", type=int, default=100, help="rows to write")
  parser.add_argument("--seed", type=int, default=0, help="the dataset seed")
  parser.add_argument("--config", default="{}",
                      help="JSON of the dataset's other config fields, e.g. "
                      "'{\"max_animals\": 5}'")
  parser.add_argument("--max_attempts", type=int,
                      default=DEFAULT_MAX_ATTEMPTS,
                      help="answers the environment takes per episode")
  parser.add_argument("--out", required=True, help="the .jsonl to write")
  args = parser.parse_args(argv)
  if args.size < 1 or args.max_attempts < 1:
    parser.error("--size and --max_attempts must be at least 1")
  try:
    written = rows(args.dataset, args.size, args.seed, args.config,
                   args.max_attempts)
  except (ImportError, ValueError) as e:
    sys.exit(f"error: {e}")
  with open(args.out, "w", encoding="utf-8") as f:
    for row in written:
      f.write(json.dumps(row) + "\n")
  print(f"wrote {len(written)} rows of {args.dataset} to {args.out}")


if __name__ == "__main__":
  main()
