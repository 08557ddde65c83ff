"""File sources: JSONL/Parquet readers, layouts, normalisation, bad rows.

Each test writes a small file and compares what the source reads against
values written out by hand (or, for normalisation, computed with numpy from
the hand-written scores).
"""

import gzip
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import seqio

from jaxrlhf.data import alignment_data
from jaxrlhf.data import file_sources
from jaxrlhf.data import pipeline
from jaxrlhf.data import tasks

Source = file_sources.AlignmentFileSource


@pytest.fixture(scope="module")
def vocab():
  return tasks.synthetic_vocabulary()


def write_jsonl(path, rows):
  path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n"
                          for r in rows))
  return str(path)


def write_parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


# --- UltraFeedback -----------------------------------------------------------


def uf_completion(response, overall, fine=None, annotations=None):
  completion = {"model": "m", "principle": "helpfulness",
                "custom_system_prompt": "Be helpful.", "response": response,
                "overall_score": overall, "critique": "ok"}
  if fine is not None:
    completion["fine-grained_score"] = fine
  completion["annotations"] = annotations or {
      "helpfulness": {"Rating": "4", "Rationale": "r"},
      "honesty": {"Rating": "4", "Rationale": "r"}}
  return completion


UF_SCORES = [[7.0, 4.5, 9.0, 2.0], [6.0, 6.0, 8.5, 3.0], [5.0, 1.0, 7.5, 4.0]]


def uf_rows():
  return [{"source": "evol_instruct", "instruction": f"instruction {i}",
           "models": ["m"] * 4,
           "completions": [uf_completion(f"response {i}.{j}", s, fine=s / 2)
                           for j, s in enumerate(scores)]}
          for i, scores in enumerate(UF_SCORES)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_ultrafeedback_trajectories_have_normalised_rewards(tmp_path, fmt):
  rows = uf_rows()
  path = (write_jsonl(tmp_path / "uf.jsonl", rows) if fmt == "jsonl"
          else write_parquet(tmp_path / "uf.parquet", rows))
  source = Source(path, kind="trajectory", layout="ultrafeedback")
  examples = source.examples()
  assert [e["prompt"] for e in examples] == [
      f"instruction {i}" for i in range(3) for _ in range(4)]
  assert [e["completion"] for e in examples][:2] == ["response 0.0",
                                                     "response 0.1"]
  raw = np.array(UF_SCORES).ravel()
  rewards = np.array([e["reward"] for e in examples])
  np.testing.assert_allclose(rewards, (raw - raw.mean()) / raw.std(),
                             rtol=1e-12)
  assert abs(rewards.mean()) < 1e-12 and abs(rewards.var() - 1) < 1e-12
  stats = source.reward_stats()
  assert stats.mean == pytest.approx(raw.mean()) and stats.count == 12


def test_ultrafeedback_fine_grained_score_and_aspect_fallback(tmp_path):
  annotations = {
      "instruction_following": [{"Rating": "3", "Rationale": "r"}],
      "honesty": {"Rating": "N/A", "Rationale": "r"},
      "truthfulness": {"Type": ["0"], "Rating": "4", "Rationale": "r"},
      "helpfulness": {"Type": ["1"], "Rating": "5", "Rationale": "r"}}
  row = {"instruction": "say hi", "completions": [
      uf_completion("hi", 8.0, fine=2.25),
      uf_completion("hello", 8.0, annotations=annotations)]}
  source = Source(write_jsonl(tmp_path / "uf.jsonl", [row]),
                  kind="trajectory", layout="ultrafeedback",
                  layout_options={"score": "fine_grained"},
                  normalize_rewards=False)
  # 2.25 as given; (3 + 4 + 5) / 3 with "N/A" left out.
  assert [e["reward"] for e in source.examples()] == [2.25, 4.0]


def test_ultrafeedback_pairs_best_against_a_random_worse(tmp_path):
  scores = [3.0, 9.0, 5.0, 1.0]
  rows = [{"instruction": f"p{i}", "completions": [
      uf_completion(f"r{j}", s) for j, s in enumerate(scores)]}
          for i in range(60)]
  rows.append({"instruction": "tie", "completions": [
      uf_completion("a", 5.0), uf_completion("b", 5.0)]})
  path = write_jsonl(tmp_path / "uf.jsonl", rows)
  source = Source(path, kind="pairs", layout="ultrafeedback",
                  on_bad_row="skip_and_report", seed=3)
  pairs = source.examples()
  assert len(pairs) == 60
  rejected = set()
  for pair in pairs:
    assert pair["chosen"] == "r1"
    worse = int(pair["rejected"][1])
    assert scores[worse] < 9.0
    assert pair["margin"] == 9.0 - scores[worse]
    rejected.add(pair["rejected"])
  assert rejected == {"r0", "r2", "r3"}  # Random, not always the worst.
  assert source.bad_row_counts() == {"no_worse_completion": 1}
  assert str(source.bad_rows()[0]).startswith(f"{path}: row 61: "
                                              "no_worse_completion")
  again = Source(path, kind="pairs", layout="ultrafeedback",
                 on_bad_row="skip_and_report", seed=3).examples()
  assert again == pairs


def test_ultrafeedback_ranking_best_first_and_bad_completion_left_out(
    tmp_path):
  row = {"instruction": "rank", "completions": [
      uf_completion("mid", 5.0), uf_completion("", 10.0),
      uf_completion("top", 8.0), uf_completion("low", 2.0)]}
  path = write_jsonl(tmp_path / "uf.jsonl", [row])
  source = Source(path, kind="ranking", layout="ultrafeedback",
                  on_bad_row="skip_and_report")
  assert source.examples() == [{"prompt": "rank",
                                "completions": ["top", "mid", "low"]}]
  assert source.bad_row_counts() == {"empty_completion": 1}
  with pytest.raises(file_sources.BadRowError,
                     match=r"row 1: empty_completion: completions\[1\]"):
    Source(path, kind="ranking", layout="ultrafeedback").examples()


# --- HH-RLHF -----------------------------------------------------------------

HH_PROMPT = ("\n\nHuman: What is a fox?\n\nAssistant: An animal."
             "\n\nHuman: What colour is it?\n\nAssistant:")


def test_hh_rlhf_splits_shared_prompt_from_final_turn(tmp_path):
  rows = [
      {"chosen": HH_PROMPT + " Usually red.",
       "rejected": HH_PROMPT + " I don't know."},
      {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected":
       "\n\nHuman: different\n\nAssistant: b"},
      {"chosen": "\n\nHuman: no reply", "rejected": "\n\nHuman: no reply"},
  ]
  path = write_jsonl(tmp_path / "hh.jsonl", rows)
  source = Source(path, kind="pairs", layout="hh_rlhf",
                  on_bad_row="skip_and_report")
  assert source.examples() == [{
      "prompt": HH_PROMPT, "chosen": " Usually red.",
      "rejected": " I don't know.", "margin": 0.0, "confidence": 1.0,
      "prompt_weight": 1.0, "annotation_batch": -1.0}]
  assert source.bad_row_counts() == {"prompts_differ": 1,
                                     "unparsable_dialogue": 1}
  assert [b.row for b in source.bad_rows()] == [2, 3]
  with pytest.raises(file_sources.BadRowError,
                     match=f"{path}: row 2: prompts_differ"):
    Source(path, kind="pairs", layout="hh_rlhf").examples()


# --- TL;DR -------------------------------------------------------------------


def tldr_row(post, choice=1, confidence=None, **info):
  row = {"info": {"id": "t3_x", "subreddit": "relationships",
                  "title": "Help me", "post": post, **info},
         "split": "train", "summaries": [
             {"text": " first summary", "policy": "a", "note": None},
             {"text": "second summary", "policy": "b", "note": None}],
         "choice": choice, "worker": "w", "batch": "batch3"}
  if confidence is not None:
    row["extra"] = {"confidence": confidence}
  return row


def test_tldr_prompt_format_choice_and_confidence(tmp_path):
  rows = [tldr_row("My post.", choice=1, confidence=6),
          tldr_row("Other.", choice=0)]
  path = write_jsonl(tmp_path / "comparisons.json", rows)
  examples = Source(path, kind="pairs", layout="tldr").examples()
  assert examples[0] == {
      "prompt": ("SUBREDDIT: r/relationships\n\nTITLE: Help me\n\n"
                 "POST: My post.\n\nTL;DR:"),
      "chosen": " second summary",  # Leading space added (detail 3).
      "rejected": " first summary", "margin": 0.0,
      "confidence": pytest.approx(6 / 9), "prompt_weight": 1.0,
      "annotation_batch": 3.0}  # its "batch3" (detail 16)
  assert examples[1]["chosen"] == " first summary"
  assert examples[1]["confidence"] == 1.0


def test_tldr_comparisons_of_one_post_share_one_weight(tmp_path):
  # TL;DR compares several summary pairs of one post; InstructGPT-style
  # weights make each post count once: 4 pairs over 2 posts, so the post with
  # 3 pairs gives each (4 / 2) / 3 and the other post's pair gets 4 / 2.
  rows = [tldr_row("Busy post.", choice=c) for c in (0, 1, 0)]
  rows.insert(1, tldr_row("Quiet post."))
  path = write_jsonl(tmp_path / "comparisons.json", rows)
  examples = Source(path, kind="pairs", layout="tldr").examples()
  assert [e["prompt_weight"] for e in examples] == pytest.approx(
      [2 / 3, 2.0, 2 / 3, 2 / 3])


def test_tldr_drops_last_paragraphs_to_fit(tmp_path, vocab):
  def prompt(post):
    return (f"SUBREDDIT: r/relationships\n\nTITLE: Help me\n\nPOST: {post}"
            "\n\nTL;DR:")
  kept_post = "red blue green\ngold cat"
  full_post = kept_post + "\ndog fox owl sun moon star rain"
  limit = len(vocab.encode(prompt(kept_post))) + 1  # + EOS
  assert len(vocab.encode(prompt(full_post))) + 1 > limit
  rows = [tldr_row(full_post),
          tldr_row("red " * 200, choice=0),  # No paragraph to drop.
          tldr_row(None, article="A CNN article.")]
  path = write_jsonl(tmp_path / "c.jsonl", rows)
  source = Source(path, kind="pairs", layout="tldr", vocabulary=vocab,
                  max_prompt_tokens=limit, on_bad_row="skip_and_report")
  assert [e["prompt"] for e in source.examples()] == [prompt(kept_post)]
  assert source.bad_row_counts() == {"prompt_too_long": 1,
                                     "missing_field": 1}
  no_cut = Source(path, kind="pairs", layout="tldr", vocabulary=vocab,
                  max_prompt_tokens=limit, on_bad_row="skip_and_report",
                  layout_options={"truncate_post_paragraphs": False})
  with pytest.raises(ValueError, match="'prompt_too_long': 2"):
    no_cut.examples()


# --- columns layout, Parquet, splits ------------------------------------------


def test_parquet_thumbs_with_nested_column_mapping(tmp_path, vocab):
  rows = [{"meta": {"question": "summarize: red"}, "answer": "red",
           "thumb": True},
          {"meta": {"question": "summarize: owl"}, "answer": "cat",
           "thumb": False}]
  path = write_parquet(tmp_path / "thumbs.parquet", rows)
  source = Source(path, kind="thumbs", vocabulary=vocab, column_mapping={
      "prompt": "meta.question", "completion": "answer", "label": "thumb"})
  assert source.examples() == [
      {"prompt": "summarize: red", "completion": "red", "label": 1.0},
      {"prompt": "summarize: owl", "completion": "cat", "label": 0.0}]


def test_validation_split_is_normalised_with_train_statistics(tmp_path):
  def rows(rewards):
    return [{"prompt": "summarize: red", "completion": "red", "reward": r}
            for r in rewards]
  train = write_jsonl(tmp_path / "train.jsonl", rows([1.0, 2.0, 3.0, 6.0]))
  valid = write_jsonl(tmp_path / "valid.jsonl.gz", [])
  with gzip.open(valid, "wt") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows([4.0, 0.0])))
  source = Source({"train": train, "validation": valid}, kind="trajectory",
                  normalize_rewards=True)
  mean, std = 3.0, math.sqrt((4 + 1 + 0 + 9) / 4)
  assert [e["reward"] for e in source.examples("validation")] == (
      pytest.approx([(4 - mean) / std, (0 - mean) / std]))
  assert source.reward_stats("validation").split == "train"


def test_glob_reads_every_match_in_order(tmp_path):
  for i in range(3):
    write_jsonl(tmp_path / f"part-{i}.jsonl", [
        {"prompt": f"p{i}", "completion": "c", "reward": i}])
  source = Source(str(tmp_path / "part-*.jsonl"), kind="trajectory")
  assert [e["prompt"] for e in source.examples()] == ["p0", "p1", "p2"]
  with pytest.raises(FileNotFoundError, match="no file matches"):
    Source(str(tmp_path / "none-*.jsonl"), kind="trajectory").examples()


def test_processes_read_disjoint_shards_and_shuffle_is_seeded(tmp_path):
  path = write_jsonl(tmp_path / "t.jsonl", [
      {"prompt": f"p{i}", "completion": "c", "reward": i} for i in range(5)])
  source = Source(path, kind="trajectory")

  def prompts(**kwargs):
    return [ex["prompt"].decode() for ex in
            source.get_dataset("train", **kwargs).as_numpy_iterator()]

  assert prompts(shuffle=False, shard_info=seqio.ShardInfo(0, 2)) == [
      "p0", "p2", "p4"]
  assert prompts(shuffle=False, shard_info=seqio.ShardInfo(1, 2)) == [
      "p1", "p3"]
  shuffled = prompts(shuffle=True, seed=1)
  assert sorted(shuffled) == [f"p{i}" for i in range(5)]
  assert prompts(shuffle=True, seed=1) == shuffled


def test_every_pass_of_training_batches_is_a_fresh_permutation(tmp_path,
                                                               vocab):
  """Through the training pipeline (seqio task, repeat, batches): each pass
  holds every example once and passes differ. seqio caches a small split in
  memory after its source and adds a shuffle buffer after the repeat; either
  would break this (the cache replays the first pass's order)."""
  path = write_jsonl(tmp_path / "t.jsonl", [
      {"prompt": "summarize: red", "completion": "red", "reward": i}
      for i in range(12)])
  alignment_data.register_file_task(
      "test_file_sources_passes", path, kind="trajectory", vocabulary=vocab,
      normalize_rewards=False, overwrite=True)

  def rewards(seed):
    batches = pipeline.BatchIterator(
        "test_file_sources_passes", "train",
        {"prompt": 8, "completion": 8}, seqio.PassThroughFeatureConverter(),
        global_batch_size=4, seed=seed)
    return [int(r) for _ in range(12) for r in next(batches)["reward"]]

  order = rewards(seed=0)
  passes = [order[i:i + 12] for i in range(0, 48, 12)]
  for one in passes:
    assert sorted(one) == list(range(12))
  assert len({tuple(p) for p in passes}) == 4
  assert rewards(seed=0) == order  # seeded: a resumed run sees the same
  assert rewards(seed=1) != order


# --- malformed rows ----------------------------------------------------------

GOOD = {"prompt": "summarize: red", "completion": "red", "reward": 1.0}
# (reason, row as written). Limits: prompt <= 5 tokens, completion <= 4.
BAD_ROWS = [
    ("invalid_json", '{"prompt": "summarize: red", \n'),
    ("missing_field", {"prompt": "summarize: red", "reward": 1.0}),
    ("missing_field", {"prompt": "summarize: red", "completion": "red"}),
    ("empty_prompt", {**GOOD, "prompt": " "}),
    ("empty_completion", {**GOOD, "completion": ""}),
    ("non_finite_reward", {**GOOD, "reward": float("nan")}),
    ("non_finite_reward", {**GOOD, "reward": float("inf")}),
    ("non_finite_reward", {**GOOD, "reward": "high"}),
    ("wrong_type", {**GOOD, "completion": ["red"]}),
    # 6 words + EOS = 7 tokens > 5.
    ("prompt_too_long", {**GOOD, "prompt": "summarize: red blue green gold "
                                           "cat"}),
    # 4 words + EOS = 5 tokens > 4.
    ("completion_too_long", {**GOOD, "completion": "red blue green gold"}),
]
LIMITS = dict(max_prompt_tokens=5, max_completion_tokens=4)


@pytest.mark.parametrize("reason,row", BAD_ROWS,
                         ids=[f"{r}-{i}" for i, (r, _) in
                              enumerate(BAD_ROWS)])
def test_each_bad_row_raises_with_file_and_row(tmp_path, vocab, reason, row):
  path = write_jsonl(tmp_path / "t.jsonl", [GOOD, row, GOOD])
  source = Source(path, kind="trajectory", vocabulary=vocab, **LIMITS)
  with pytest.raises(file_sources.BadRowError) as error:
    source.examples()
  assert str(error.value).startswith(f"{path}: row 2: {reason}: ")
  assert "on_bad_row='skip_and_report'" in str(error.value)


def test_bad_rows_are_skipped_counted_and_logged(tmp_path, vocab, capsys):
  path = write_jsonl(tmp_path / "t.jsonl",
                     [GOOD] + [row for _, row in BAD_ROWS] + ["\n", GOOD])
  source = Source(path, kind="trajectory", vocabulary=vocab,
                  on_bad_row="skip_and_report", **LIMITS)
  assert len(source.examples()) == 2
  expected = {}
  for reason, _ in BAD_ROWS:
    expected[reason] = expected.get(reason, 0) + 1
  assert source.bad_row_counts() == expected
  # Rows are numbered by line; line 14 is blank and not a row.
  assert [(b.row, b.reason) for b in source.bad_rows()] == [
      (i + 2, reason) for i, (reason, _) in enumerate(BAD_ROWS)]
  assert all(b.path == path for b in source.bad_rows())
  [summary] = [line for line in capsys.readouterr().out.splitlines()
               if "skipped" in line]
  assert f"skipped {len(BAD_ROWS)} bad rows" in summary
  assert "non_finite_reward=3" in summary and "prompt_too_long=1" in summary
  assert source.num_input_examples("train") == 2


def test_thumbs_label_must_be_binary_in_both_modes(tmp_path):
  rows = [{"prompt": "p", "completion": "c", "label": 1},
          {"prompt": "p", "completion": "c", "label": 2},
          {"prompt": "p", "completion": "c", "label": "yes"}]
  path = write_jsonl(tmp_path / "t.jsonl", rows)
  with pytest.raises(file_sources.BadRowError, match="row 2: bad_label"):
    Source(path, kind="thumbs").examples()
  source = Source(path, kind="thumbs", on_bad_row="skip_and_report")
  assert source.bad_row_counts() == {"bad_label": 2}


def test_ranking_completion_count_bounds(tmp_path):
  rows = [{"prompt": "p", "completions": ["a", "b"]},
          {"prompt": "p", "completions": ["a"]},
          {"prompt": "p", "completions": ["a", "b", "c", "d"]}]
  path = write_jsonl(tmp_path / "r.jsonl", rows)
  source = Source(path, kind="ranking", max_completions=3,
                  on_bad_row="skip_and_report")
  assert source.bad_row_counts() == {"too_few_completions": 1,
                                     "too_many_completions": 1}
  with pytest.raises(file_sources.BadRowError,
                     match="row 2: too_few_completions"):
    Source(path, kind="ranking", max_completions=3).examples()


def test_a_file_of_only_bad_rows_is_an_error(tmp_path):
  path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p"}])
  with pytest.raises(ValueError, match="no usable example"):
    Source(path, kind="trajectory", on_bad_row="skip_and_report").examples()


@pytest.mark.parametrize("kwargs,message", [
    (dict(kind="trajectory", layout="hh_rlhf"), "gives kinds"),
    (dict(kind="pairs", layout="tldr", layout_options={"scale": 2}),
     "not understood"),
    (dict(kind="pairs", column_mapping={"reward": "r"}),
     "not fields of kind"),
    (dict(kind="pairs", on_bad_row="ignore"), "on_bad_row"),
    (dict(kind="pairs", normalize_rewards=True), "normalize_rewards"),
    (dict(kind="pairs", max_prompt_tokens=8), "need the vocabulary"),
    (dict(kind="votes"), "unknown data kind"),
])
def test_configuration_errors_name_the_problem(tmp_path, kwargs, message):
  path = write_jsonl(tmp_path / "t.jsonl", [GOOD])
  with pytest.raises(ValueError, match=message):
    Source(path, **kwargs)


def test_register_file_task_exposes_the_source(tmp_path, vocab):
  path = write_jsonl(tmp_path / "uf.jsonl", uf_rows())
  task = alignment_data.register_file_task(
      "test_file_sources_uf", path, layout="ultrafeedback",
      kind="trajectory", vocabulary=vocab, overwrite=True)
  assert isinstance(task.source, file_sources.AlignmentFileSource)
  rewards = [float(ex["reward"]) for ex in task.get_dataset(
      {"prompt": 8, "completion": 8}, split="train", shuffle=False)
             .as_numpy_iterator()]
  raw = np.array(UF_SCORES).ravel()
  np.testing.assert_allclose(rewards, (raw - raw.mean()) / raw.std(),
                             rtol=1e-6)
