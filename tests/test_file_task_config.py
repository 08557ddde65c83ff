"""config.data.files registers the run's task: under its own name, with the
configured lengths as the limits of good rows; config.eval.task must name a
task the policy can be judged on; a checkpoint trained on another
vocabulary is refused."""

import json

import jax
import pytest
import seqio

from conftest import tiny_config
from jaxrlhf import sharding
from jaxrlhf.data import file_sources
from jaxrlhf.data import tasks
from jaxrlhf.data import vocab
from jaxrlhf import algorithms
from jaxrlhf.data import file_tasks
from jaxrlhf.train import loop


def _pairs_file(path, completions):
  with open(path, "w") as f:
    for c in completions:
      f.write(json.dumps({"prompt": "summarize: red blue", "chosen": c,
                          "rejected": "red"}) + "\n")
  return str(path)


def test_files_cannot_replace_a_registered_task(tmp_path):
  config = tiny_config(algorithm="dpo")  # data.task: synthetic_summarize
  config.data.files.train = _pairs_file(tmp_path / "p.jsonl", ["red blue"])
  with pytest.raises(ValueError, match=r"config.data.task: "
                     r"'synthetic_summarize' is already a registered seqio "
                     r"task.*--config.data.task="):
    file_tasks.register_task_from_files(config, "pairs")
  # The built-in task is untouched.
  source = seqio.get_mixture_or_task("synthetic_summarize").source
  assert not isinstance(source, file_sources.AlignmentFileSource)


def test_completions_may_fill_targets_length_eos_included(tmp_path):
  # targets_length 5: four words + EOS fit, five words + EOS do not.
  config = tiny_config(algorithm="dpo", data__task="files_length_limit",
                       data__targets_length=5,
                       data__files__on_bad_row="skip_and_report")
  config.data.files.train = _pairs_file(
      tmp_path / "p.jsonl",
      ["red blue green gold", "red blue green gold cat", "red"])
  file_tasks.register_task_from_files(config, "pairs")
  # A second registration by the same process replaces its own file task.
  file_tasks.register_task_from_files(config, "pairs")
  source = seqio.get_mixture_or_task("files_length_limit").source
  assert [e["chosen"] for e in source.examples()] == ["red blue green gold",
                                                       "red"]
  assert source.bad_row_counts() == {"completion_too_long": 1}


@pytest.mark.parametrize("eval_task,message", [
    ("synthetic_summarise", r"config.eval.task: no seqio task or mixture "
     r"named 'synthetic_summarise'"),
    ("files_no_gold", r"config.eval.task: 'files_no_gold' has no gold "
     r"reward"),
])
def test_eval_task_must_exist_and_have_a_gold_reward(tmp_path, eval_task,
                                                     message):
  config = tiny_config(algorithm="dpo", data__task="files_no_gold",
                       eval__task=eval_task)
  config.data.files.train = _pairs_file(tmp_path / "p.jsonl", ["red blue"])
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    with pytest.raises(ValueError, match=message):
      algorithms.build(config, mesh)


def test_checkpoint_of_another_vocabulary_is_refused(tmp_path):
  # An SFT run on the synthetic task (only its config.json is needed: the
  # check comes before any parameter is read).
  loop.prepare_workdir(str(tmp_path / "sft"), tiny_config(algorithm="sft"))
  other = vocab.word_vocabulary(["summarize:", "red", "blue", "fox"])
  config = tiny_config(algorithm="dpo", data__task="files_other_vocab",
                       init__policy_checkpoint=str(tmp_path / "sft"),
                       eval__task="synthetic_summarize")
  config.data.files.train = _pairs_file(tmp_path / "p.jsonl", ["red blue"])
  config.data.files.vocabulary = other.sentencepiece_model_file
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = algorithms.build(config, mesh)
    with pytest.raises(ValueError) as error:
      trainer.init_state()
  message = str(error.value)
  assert message.startswith("config.init.policy_checkpoint: ")
  assert "was trained with vocabulary" in message
  assert vocab.describe(tasks.synthetic_vocabulary()) in message
  assert vocab.describe(other) in message


@pytest.mark.parametrize("field", ["train", "validation", "vocabulary"])
def test_missing_files_name_their_field(tmp_path, field):
  config = tiny_config(algorithm="dpo", data__task="files_missing")
  config.data.files.train = _pairs_file(tmp_path / "p.jsonl", ["red blue"])
  config.data.files[field] = str(tmp_path / "nope" / "*.jsonl")
  with pytest.raises(ValueError, match=rf"config.data.files.{field}: no file "
                     "matches"):
    file_tasks.register_task_from_files(config, "pairs")
