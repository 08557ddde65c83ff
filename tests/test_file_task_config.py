"""config.data.files registers the run's task: under its own name, with the
configured lengths as the limits of good rows."""

import json

import pytest
import seqio

from conftest import tiny_config
from jaxrlhf.data import file_sources
from jaxrlhf.data import tasks  # noqa: F401  (registers the built-in tasks)
from jaxrlhf.recipes import base


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
    base.register_task_from_files(config, "pairs")
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
  base.register_task_from_files(config, "pairs")
  # A second registration by the same process replaces its own file task.
  base.register_task_from_files(config, "pairs")
  source = seqio.get_mixture_or_task("files_length_limit").source
  assert [e["chosen"] for e in source.examples()] == ["red blue green gold",
                                                       "red"]
  assert source.bad_row_counts() == {"completion_too_long": 1}
