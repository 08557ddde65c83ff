"""A seqio task registered by the user (as in a notebook) trains by name."""

import json

import seqio
import tensorflow as tf

from conftest import tiny_config
from jaxrlhf.data import tasks
from jaxrlhf.train import loop


def _reverse_words_dataset(split, shuffle_files, seed=None):
  del split, shuffle_files, seed
  words = ["red blue", "cat dog fox", "sun moon", "oak elm fig lime"] * 16
  return tf.data.Dataset.from_tensor_slices({
      "inputs": words, "targets": [" ".join(w.split()[::-1]) for w in words]})


def test_user_registered_task_trains(tmp_path):
  vocabulary = tasks.synthetic_vocabulary()
  if "user_reverse_words" not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add(
        "user_reverse_words",
        source=seqio.FunctionDataSource(_reverse_words_dataset,
                                        splits=("train", "validation")),
        preprocessors=[seqio.preprocessors.tokenize,
                       seqio.preprocessors.append_eos_after_trim],
        output_features={k: seqio.Feature(vocabulary)
                         for k in ("inputs", "targets")})
  config = tiny_config(data__task="user_reverse_words", train__num_steps=30,
                       optimizer__warmup_steps=0)
  summary = loop.train(config, str(tmp_path))
  # No gold reward for this task: evaluation reports loss and accuracy only.
  assert "eval/gold_reward" not in summary
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  before = next(r for r in rows if r["step"] == 0)["eval/loss"]
  assert summary["eval/loss"] < 0.5 * before
