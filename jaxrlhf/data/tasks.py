"""The built-in seqio tasks, and gold rewards looked up by task name.

Importing this module registers the tasks in seqio's global `TaskRegistry`.
The trainer reads any registered task by name, so a task a user registers in a
notebook works the same way; a gold reward is optional and only used for
evaluation.
"""

import functools
from typing import Callable, Dict, Optional

import seqio
import tensorflow as tf

from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import names
from jaxrlhf.data import synthetic
from jaxrlhf.data import synthetic_arithmetic
from jaxrlhf.data import vocab

# gold_reward(prompt, completion, finished) -> float, by task name.
GoldReward = Callable[[str, str, bool], float]
_GOLD_REWARDS: Dict[str, GoldReward] = {}

# The built-in tasks' names (`names`, which a plan reads without this
# module's seqio).
SYNTHETIC_SUMMARIZE = names.SYNTHETIC_SUMMARIZE
SYNTHETIC_SUMMARIZE_GRADED = names.SYNTHETIC_SUMMARIZE_GRADED
_SYNTHETIC_GRADED = {SYNTHETIC_SUMMARIZE: False,
                     SYNTHETIC_SUMMARIZE_GRADED: True}
# "test" holds prompts no run trains or selects on, for experiments that
# judge policies on more held-out prompts than "validation" has.
SYNTHETIC_SPLIT_SIZES = {"train": 20000, "validation": 512, "test": 2000}
# Sums with an exact answer (synthetic_arithmetic.py): a verifiable task whose
# prompts carry their `answer` column to the reward functions.
SYNTHETIC_ARITHMETIC = names.SYNTHETIC_ARITHMETIC


def register_gold_reward(task_name: str, fn: GoldReward) -> None:
  _GOLD_REWARDS[task_name] = fn


def gold_reward_for(task_name: str) -> Optional[GoldReward]:
  return _GOLD_REWARDS.get(task_name)


def run_vocabulary(run: dict) -> Optional[seqio.Vocabulary]:
  """The vocabulary a jaxrlhf run (its config.json, as a dict) used, or
  None when it cannot be told (its task is not registered here)."""
  data = run.get("data", {})
  files = data.get("files", {})
  if files.get("vocabulary"):
    return vocab.from_file(files["vocabulary"])
  task = data.get("task")
  if task in seqio.TaskRegistry.names() or task in seqio.MixtureRegistry.names():
    features = seqio.get_mixture_or_task(task).output_features
    feature = (features.get("targets") or features.get("prompt")
               or next(iter(features.values())))
    return feature.vocabulary
  if files.get("train"):  # a file task with the default vocabulary
    return synthetic_vocabulary()
  return None


def synthetic_vocabulary() -> seqio.SentencePieceVocabulary:
  return vocab.word_vocabulary(synthetic.VOCABULARY_WORDS)


@functools.lru_cache(maxsize=None)
def _synthetic_examples(split: str, graded: bool = False):
  return synthetic.make_examples(split, SYNTHETIC_SPLIT_SIZES[split],
                                 graded=graded)


def _synthetic_dataset_fn(split, shuffle_files, seed=None, graded=False):
  del shuffle_files, seed  # One in-memory file; seqio shuffles examples.
  examples = _synthetic_examples(split, graded)
  return tf.data.Dataset.from_tensor_slices({
      key: [ex[key] for ex in examples] for key in ("inputs", "targets")})


@functools.lru_cache(maxsize=None)
def _arithmetic_examples(split: str):
  return synthetic_arithmetic.make_examples(
      split, synthetic_arithmetic.SPLIT_SIZES[split])


def _arithmetic_dataset_fn(split, shuffle_files, seed=None):
  del shuffle_files, seed  # One in-memory file; seqio shuffles examples.
  examples = _arithmetic_examples(split)
  return tf.data.Dataset.from_tensor_slices({
      "inputs": [ex["inputs"] for ex in examples],
      "targets": [ex["targets"] for ex in examples],
      alignment_kinds.column_feature("answer"): [
          alignment_kinds.encode_column_value(ex["answer"])
          for ex in examples]})


def _register_arithmetic_task():
  if SYNTHETIC_ARITHMETIC in seqio.TaskRegistry.names():
    return
  arithmetic_vocabulary = synthetic_arithmetic.vocabulary()
  seqio.TaskRegistry.add(
      SYNTHETIC_ARITHMETIC,
      source=seqio.FunctionDataSource(
          _arithmetic_dataset_fn,
          splits=tuple(synthetic_arithmetic.SPLIT_SIZES),
          num_input_examples=synthetic_arithmetic.SPLIT_SIZES),
      preprocessors=[seqio.preprocessors.tokenize,
                     seqio.preprocessors.append_eos_after_trim],
      output_features={
          "inputs": seqio.Feature(arithmetic_vocabulary, add_eos=True),
          "targets": seqio.Feature(arithmetic_vocabulary, add_eos=True)})
  register_gold_reward(SYNTHETIC_ARITHMETIC, synthetic_arithmetic.gold_reward)


def _register_builtin_tasks():
  for name, graded in _SYNTHETIC_GRADED.items():
    if name in seqio.TaskRegistry.names():
      continue
    features = {
        "inputs": seqio.Feature(synthetic_vocabulary(), add_eos=True),
        "targets": seqio.Feature(synthetic_vocabulary(), add_eos=True),
    }
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(
            functools.partial(_synthetic_dataset_fn, graded=graded),
            splits=tuple(SYNTHETIC_SPLIT_SIZES),
            num_input_examples=SYNTHETIC_SPLIT_SIZES),
        preprocessors=[seqio.preprocessors.tokenize,
                       seqio.preprocessors.append_eos_after_trim],
        output_features=features)
    register_gold_reward(name, synthetic.gold_reward)
  _register_arithmetic_task()


_register_builtin_tasks()
