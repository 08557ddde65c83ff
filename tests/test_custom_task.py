"""A seqio task registered by the user (as in a notebook) trains by name,
and its pipeline is traced without AutoGraph unless it needs it."""

import json

import numpy as np
import seqio
import tensorflow as tf

from conftest import synthetic_feedback_file, tiny_config
from jaxrlhf.data import alignment_data
from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import feature_converters
from jaxrlhf.data import file_tasks
from jaxrlhf.data import pipeline
from jaxrlhf.data import prompts
from jaxrlhf.data import synthetic
from jaxrlhf.data import tasks
from jaxrlhf.train import loop


def _reverse_words_dataset(split, shuffle_files, seed=None):
  del split, shuffle_files, seed
  words = ["red blue", "cat dog fox", "sun moon", "oak elm fig lime"] * 16
  return tf.data.Dataset.from_tensor_slices({
      "inputs": words, "targets": [" ".join(w.split()[::-1]) for w in words]})


def _register_words_task(name, *preprocessors):
  """Registers (once) a task over the reversed-words examples, as a user
  would: `preprocessors`, then seqio's tokenize and EOS."""
  if name not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add(
        name, source=seqio.FunctionDataSource(_reverse_words_dataset,
                                              splits=("train", "validation")),
        preprocessors=[*preprocessors, seqio.preprocessors.tokenize,
                       seqio.preprocessors.append_eos_after_trim],
        output_features={k: seqio.Feature(tasks.synthetic_vocabulary())
                         for k in ("inputs", "targets")})


def test_user_registered_task_trains(tmp_path):
  _register_words_task("user_reverse_words")
  config = tiny_config(data__task="user_reverse_words", train__num_steps=30,
                       optimizer__warmup_steps=0)
  summary = loop.train(config, str(tmp_path))
  # No gold reward for this task: evaluation reports loss and accuracy only.
  assert "eval/gold_reward" not in summary
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  before = next(r for r in rows if r["step"] == 0)["eval/loss"]
  assert summary["eval/loss"] < 0.5 * before


# --- pipelines are traced without AutoGraph (pipeline.traced_as_written) ----


@seqio.map_over_dataset
def _first_word_of_long_targets(example):
  words = tf.strings.split(example["targets"])
  if tf.size(words) > 2:  # A Python `if` on a tensor: AutoGraph's to rewrite.
    return dict(example, targets=words[0])
  return example


def test_a_preprocessor_that_needs_autograph_gets_it():
  _register_words_task("user_autograph_words", _first_word_of_long_targets)
  vocabulary = tasks.synthetic_vocabulary()
  lengths = {"inputs": 8, "targets": 4}
  converter = feature_converters.sft_feature_converter("encoder_decoder")
  before = pipeline.autograph_fallbacks
  features, texts = pipeline.eval_examples(
      "user_autograph_words", "validation", lengths, converter, 4)
  assert pipeline.autograph_fallbacks == before + 1
  # Targets of more than two words kept only their first (the `if` ran per
  # example, as AutoGraph's tf.cond).
  assert [t["targets"] for t in texts] == ["blue red", "fox", "moon sun",
                                           "lime"]
  np.testing.assert_array_equal(
      features["decoder_target_tokens"][1],
      list(vocabulary.encode("fox")) + [1] + [0] * (3 - len(
          vocabulary.encode("fox"))))
  batch = next(pipeline.BatchIterator(
      "user_autograph_words", "train", lengths, converter,
      global_batch_size=4, seed=0, shuffle=False))
  assert pipeline.autograph_fallbacks == before + 2
  np.testing.assert_array_equal(batch["decoder_target_tokens"],
                                features["decoder_target_tokens"])


def test_the_built_in_pipelines_are_traced_as_written(tmp_path):
  """No map function of the synthetic task, the file tasks (demonstrations
  and each kind the synthetic labeller writes) or the feature converters
  needs AutoGraph (each fallback builds the pipeline twice)."""
  before = pipeline.autograph_fallbacks
  for kind in ("pairs", "trajectory", "ranking"):
    alignment_data.register_file_task(
        f"test_traced_{kind}", synthetic_feedback_file(tmp_path, kind, 8),
        kind=kind, vocabulary=tasks.synthetic_vocabulary(), overwrite=True)
    fields = alignment_kinds.get_kind(kind).completion_fields
    for architecture in ("encoder_decoder", "decoder_only"):
      next(pipeline.BatchIterator(
          f"test_traced_{kind}", "train",
          {"prompt": 64, **{f: 16 for f in fields}},
          alignment_data.feature_converter_for(
              kind, architecture,
              **({"num_completions": 2} if kind == "ranking" else {})),
          global_batch_size=2, seed=0))
  demonstrations = tmp_path / "demonstrations.jsonl"
  demonstrations.write_text("".join(
      json.dumps({"prompt": e["inputs"], "completion": e["targets"]}) + "\n"
      for e in synthetic.make_examples("train", 8)))
  file_tasks.register_demonstrations_task(
      "test_traced_demonstrations", {"train": str(demonstrations),
                                     "validation": str(demonstrations)},
      vocabulary=tasks.synthetic_vocabulary(), max_prompt_tokens=64)
  for task in ("synthetic_summarize", "test_traced_demonstrations"):
    for architecture in ("encoder_decoder", "decoder_only"):
      pipeline.eval_examples(
          task, "validation", {"inputs": 64, "targets": 16},
          feature_converters.sft_feature_converter(architecture), 4)
    prompts.load_prompts(task, "validation", 64)
    prompts.held_out_prompts(task, "validation", 64, 4)
  assert pipeline.autograph_fallbacks == before
