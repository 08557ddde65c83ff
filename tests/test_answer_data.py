"""Prompts with answers: the GSM8K and MATH layouts and extra columns of the
"columns" layout, in JSON lines and Parquet files written here, through
the file task to `prompts.load_prompts`' texts and columns; bad rows
reported. Expected values are written out by hand."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import seqio

from conftest import tiny_config
from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import feature_converters as fc
from jaxrlhf.data import file_sources
from jaxrlhf.data import file_tasks
from jaxrlhf.data import pipeline
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.data import synthetic
from jaxrlhf.data import tasks

DEMONSTRATIONS = alignment_kinds.DEMONSTRATIONS


def write(path, rows, fmt):
  if fmt == "jsonl":
    path = path.with_suffix(".jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  else:
    path = path.with_suffix(".parquet")
    pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


GSM8K_ROWS = [
    {"question": "red has 3 fox and 4 owl. how many?",
     "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "the sun costs $1,200.", "answer": "so\n#### 1,200"},
    {"question": "no marker", "answer": "it is 5"},
    {"question": None, "answer": "#### 1"},
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_gsm8k_rows_give_question_worked_answer_and_final_number(tmp_path,
                                                                 fmt):
  source = file_sources.AlignmentFileSource(
      write(tmp_path / "gsm8k", GSM8K_ROWS, fmt), kind=DEMONSTRATIONS,
      layout="gsm8k", on_bad_row="skip_and_report")
  assert source.extra_columns == ("answer",)
  assert source.examples() == [
      {"prompt": "red has 3 fox and 4 owl. how many?",
       "completion": "3 + 4 = <<3+4=7>>7\n#### 7", "answer": "7"},
      {"prompt": "the sun costs $1,200.", "completion": "so\n#### 1,200",
       "answer": "1200"}]
  assert source.bad_row_counts() == {"no_final_answer": 1,
                                     "missing_field": 1}
  assert [str(b).split(": ", 1)[1] for b in source.bad_rows()] == [
      "row 3: no_final_answer: 'answer' has no final answer '#### <number>'.",
      "row 4: missing_field: 'question' is missing or null."]


MATH_ROWS = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{2}$?",
     "solution": "It is $\\boxed{1}$.", "level": "Level 1",
     "type": "Prealgebra"},
    {"problem": "Simplify.", "solution":
     "First \\boxed{2}, then $\\boxed{\\frac{\\sqrt{2}}{2}}$.",
     "level": "Level 5", "type": "Algebra"},
    {"problem": "Unboxed.", "solution": "The answer is 3.",
     "level": "Level 2", "type": "Algebra"},
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_math_rows_give_problem_solution_and_last_boxed_answer(tmp_path, fmt):
  rows = MATH_ROWS + [{"problem": "No level.", "solution": "\\boxed{x}"}]
  if fmt == "parquet":  # One schema for every row: nulls where absent.
    rows[-1] = {**rows[-1], "level": None, "type": None}
  source = file_sources.AlignmentFileSource(
      write(tmp_path / "math", rows, fmt), kind=DEMONSTRATIONS,
      layout="math", on_bad_row="skip_and_report")
  assert [(e["prompt"], e["answer"], e["level"], e["type"])
          for e in source.examples()] == [
              ("What is $\\frac{1}{2} + \\frac{1}{2}$?", "1", "Level 1",
               "Prealgebra"),
              ("Simplify.", "\\frac{\\sqrt{2}}{2}", "Level 5", "Algebra"),
              ("No level.", "x", None, None)]
  assert source.examples()[1]["completion"] == MATH_ROWS[1]["solution"]
  assert source.bad_row_counts() == {"no_final_answer": 1}
  with pytest.raises(file_sources.BadRowError,
                     match=r"row 3: no_final_answer: 'solution' has no "
                     r"\\boxed\{\.\.\.\} final answer"):
    file_sources.AlignmentFileSource(
        write(tmp_path / "math", rows, fmt), kind=DEMONSTRATIONS,
        layout="math").examples()


def test_columns_layout_carries_the_extra_columns_it_names(tmp_path):
  rows = [{"q": "red fox", "sol": "fox", "final": "1",
           "meta": {"tests": ["assert f(1) == 2", "assert f(0) == 1"]}},
          {"q": "blue owl", "sol": "owl", "final": 2, "meta": {"tests": []}},
          {"q": "sun", "sol": "moon", "meta": {"tests": []}}]
  source = file_sources.AlignmentFileSource(
      write(tmp_path / "rows", rows, "jsonl"), kind=DEMONSTRATIONS,
      column_mapping={"prompt": "q", "completion": "sol", "answer": "final",
                      "tests": "meta.tests"},
      on_bad_row="skip_and_report")
  assert source.extra_columns == ("answer", "tests")
  assert source.examples() == [
      {"prompt": "red fox", "completion": "fox", "answer": "1",
       "tests": ["assert f(1) == 2", "assert f(0) == 1"]},
      {"prompt": "blue owl", "completion": "owl", "answer": 2, "tests": []}]
  assert source.bad_rows()[0].detail == ("column 'final' (extra column "
                                         "'answer') is missing or null.")


@pytest.mark.parametrize("mapping,message", [
    ({"prompt": "q", "my answer": "a"}, r"extra column name 'my answer' must "
     r"be a Python identifier"),
    ({"prompt": "q", "prompts": "a"}, r"'prompts' cannot name an extra "
     r"column"),
])
def test_extra_column_names_must_be_keyword_arguments(tmp_path, mapping,
                                                      message):
  path = write(tmp_path / "rows", [{"q": "x", "completion": "y"}], "jsonl")
  with pytest.raises(ValueError, match=message):
    file_sources.AlignmentFileSource(path, kind=DEMONSTRATIONS,
                                     column_mapping=mapping)


def test_extra_columns_are_for_demonstrations_only(tmp_path):
  path = write(tmp_path / "rows", [{"prompt": "x", "chosen": "y",
                                    "rejected": "z", "a": 1}], "jsonl")
  with pytest.raises(ValueError, match=r"\['answer'\] are not fields of kind "
                     r"'pairs'.*extra columns are carried for "
                     r"demonstrations only"):
    file_sources.AlignmentFileSource(path, kind="pairs",
                                     column_mapping={"answer": "a"})


def test_a_value_json_cannot_hold_is_a_bad_row(tmp_path):
  # Parquet binary becomes bytes, which JSON cannot hold.
  path = str(tmp_path / "rows.parquet")
  pq.write_table(pa.Table.from_pylist(
      [{"prompt": "x", "completion": "y", "blob": b"\x00"},
       {"prompt": "x2", "completion": "y", "blob": None},
       {"prompt": "x3", "completion": "y", "blob": b""}]), path)
  good = str(tmp_path / "good.parquet")
  pq.write_table(pa.Table.from_pylist(
      [{"prompt": "x4", "completion": "y", "blob": "text"}]), good)
  source = file_sources.AlignmentFileSource(
      [path, good], kind=DEMONSTRATIONS, column_mapping={"blob": "blob"},
      on_bad_row="skip_and_report")
  assert source.examples() == [{"prompt": "x4", "completion": "y",
                                "blob": "text"}]
  assert source.bad_row_counts() == {"wrong_type": 2, "missing_field": 1}
  assert source.bad_rows()[0].detail == ("extra column 'blob' holds a bytes, "
                                         "which JSON cannot hold.")


def test_config_files_reach_online_prompts_with_texts_and_answers(tmp_path):
  fmt = "parquet"  # (Both formats are read alike: the layout tests above.)
  rows = [{"question": f"red {'fox ' * i}count", "answer": f"#### {i}"}
          for i in range(1, 9)]
  name = "gsm8k_files"
  config = tiny_config(algorithm="sft", data__task=name,
                       data__inputs_length=16, data__targets_length=8)
  config.data.files.train = write(tmp_path / "train", rows, fmt)
  config.data.files.layout = "gsm8k"
  config.data.files.holdout_validation_prompts = 2
  file_tasks.register_task_from_files(config, file_tasks.DEMONSTRATIONS)
  try:
    expected = {r["question"]: r["answer"][len("#### "):] for r in rows}
    train = prompts_lib.load_prompts(name, "train", 16)
    held = prompts_lib.load_prompts(name, "validation", 16)
    assert len(train.texts) == 6 and len(held.texts) == 2
    assert sorted(train.texts + held.texts) == sorted(expected)
    vocabulary = tasks.synthetic_vocabulary()
    for prompts in (train, held):
      assert list(prompts.columns) == ["answer"]
      # Row i's text, tokens and answer belong to the same file row.
      for text, answer, tokens in zip(prompts.texts,
                                      prompts.columns["answer"],
                                      prompts.tokens):
        assert answer == expected[text]
        assert tokens[tokens != 0].tolist() == (
            vocabulary.encode(text) + [vocabulary.eos_id])
    # SFT reads the same task: the extra feature does not disturb batches.
    batch = next(pipeline.BatchIterator(
        name, "train", {"inputs": 16, "targets": 8},
        fc.sft_feature_converter("encoder_decoder"), global_batch_size=2,
        seed=0, shuffle=False, num_epochs=1))
    assert sorted(batch) == ["decoder_input_tokens", "decoder_loss_weights",
                             "decoder_target_tokens", "encoder_input_tokens"]
  finally:
    seqio.TaskRegistry.remove(name)


def test_cut_prompts_keep_their_columns_and_show_the_cut_text(tmp_path):
  # (The word vocabulary reads a newline as part of a word: spaces around.)
  rows = [{"q": "red fox \n blue owl \n gold sun", "sol": "x",
           "final": "3"},
          {"q": "cat", "sol": "y", "final": "4"}]
  vocabulary = tasks.synthetic_vocabulary()
  name = "answer_columns_cut"
  file_tasks.register_demonstrations_task(
      name, write(tmp_path / "rows", rows, "jsonl"), vocabulary=vocabulary,
      column_mapping={"prompt": "q", "completion": "sol", "answer": "final"})
  try:
    limit = len(vocabulary.encode("red fox \n blue owl")) + 1
    prompts = prompts_lib.load_prompts(name, "train", limit)
    assert prompts.num_cut == 1
    assert prompts.texts == ["red fox \n blue owl", "cat"]
    assert prompts.columns == {"answer": ["3", "4"]}
  finally:
    seqio.TaskRegistry.remove(name)


def test_a_task_without_extra_columns_has_none():
  prompts = prompts_lib.load_prompts("synthetic_summarize", "validation", 16)
  assert prompts.columns == {}
  expected = [ex["inputs"] for ex in synthetic.make_examples(
      "validation", tasks.SYNTHETIC_SPLIT_SIZES["validation"])]
  assert prompts.texts == expected
  np.testing.assert_array_equal(
      prompts.tokens[0][prompts.tokens[0] != 0],
      tasks.synthetic_vocabulary().encode(expected[0]) + [1])


def test_a_prompt_and_answer_file_without_completions_gives_online_prompts(
    tmp_path):
  """A GRPO file holds a question and its answer, no completion: the
  prompts kind reads it (through the column mapping) where demonstrations
  refuse it, and the config's online algorithms ask for that kind."""
  from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
  from jaxrlhf.algorithms import trainer  # pylint: disable=g-import-not-at-top
  rows = [{"q": f"what is {i} + {i}", "final": 2 * i} for i in range(1, 5)]
  path = write(tmp_path / "grpo", rows, "jsonl")
  mapping = {"prompt": "q", "answer": "final"}
  with pytest.raises(file_sources.BadRowError, match="missing_field"):
    file_sources.AlignmentFileSource(
        [path], kind=DEMONSTRATIONS, column_mapping=mapping).examples()
  assert trainer.files_kind(algorithms.get("grpo")) == file_tasks.PROMPTS
  assert trainer.files_kind(algorithms.get("sft")) == file_tasks.DEMONSTRATIONS
  name = "grpo_files"
  config = tiny_config(algorithm="grpo", data__task=name,
                       data__inputs_length=16, data__targets_length=4)
  config.data.files.train = path
  config.data.files.column_mapping = "prompt=q,answer=final"
  file_tasks.register_task_from_files(config, file_tasks.PROMPTS)
  try:
    prompts = prompts_lib.load_prompts(name, "train", 16)
    assert sorted(zip(prompts.texts, prompts.columns["answer"])) == [
        (r["q"], r["final"]) for r in rows]
  finally:
    seqio.TaskRegistry.remove(name)
