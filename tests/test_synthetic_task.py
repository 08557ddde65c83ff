"""The synthetic task: gold reward by hand, vocabulary, seqio batches."""

import numpy as np
import pytest
import seqio

from jaxrlhf.data import synthetic
from jaxrlhf.data import tasks
from jaxrlhf.data import vocab

PROMPT = "summarize: fox red fox owl red"  # ideal summary: "fox red owl"


@pytest.mark.parametrize("completion,finished,expected", [
    ("fox red owl", True, 1.0),            # accurate, complete, concise
    ("owl fox red", True, 1.0),            # order does not matter
    ("fox red", True, 0.8),                # P 1, R 2/3 -> F1 0.8
    ("fox red owl owl", True, 6 / 7),      # P 3/4, R 1 -> F1 6/7
    ("fox red owl cat", True, 6 / 7),      # a foreign word costs the same
    ("fox fox fox fox", True, 2 / 7),      # P 1/4, R 1/3 -> F1 2/7
    ("cat dog", True, 0.0),                # nothing right
    ("", True, 0.0),                       # empty
    ("fox red owl", False, 0.0),           # never ended
])
def test_gold_reward_by_hand(completion, finished, expected):
  assert synthetic.gold_reward(PROMPT, completion, finished) == pytest.approx(
      expected)


def test_prompt_prefix_is_optional():
  assert synthetic.gold_reward("fox red", "red fox") == 1.0


def test_examples_are_deterministic_and_imperfect():
  a = synthetic.make_examples("train", 500)
  assert a == synthetic.make_examples("train", 500)
  assert a != synthetic.make_examples("validation", 500)
  ideal = [synthetic.gold_reward(e["inputs"], e["ideal"]) for e in a]
  demos = [synthetic.gold_reward(e["inputs"], e["targets"]) for e in a]
  assert min(ideal) == 1.0
  # Demonstrations make every kind of mistake, leaving headroom above SFT.
  assert 0.7 < np.mean(demos) < 0.95
  assert any(len(e["targets"].split()) < len(e["ideal"].split()) for e in a)
  assert any(len(e["targets"].split()) > len(e["ideal"].split()) for e in a)


def test_word_vocabulary_has_t5_special_ids_and_is_stable(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXRLHF_CACHE_DIR", str(tmp_path))
  words = ["summarize:", "fox", "red"]
  v = vocab.word_vocabulary(words)
  assert (v.pad_id, v.eos_id, v.unk_id) == (0, 1, 2)
  assert v.encode("summarize: red fox") == [3, 5, 4]
  assert v.encode("zebra") == [2]
  assert v.decode([4, 5]) == "fox red"
  # Same words, same file; built without any training run.
  assert vocab.word_model_proto(words) == vocab.word_model_proto(list(words))
  assert len(list(tmp_path.iterdir())) == 1


def test_registered_task_yields_encdec_batches():
  assert tasks.SYNTHETIC_SUMMARIZE in seqio.TaskRegistry.names()
  ds = seqio.get_dataset(
      tasks.SYNTHETIC_SUMMARIZE, {"inputs": 16, "targets": 16},
      seqio.EncDecFeatureConverter(pack=False), dataset_split="validation",
      shuffle=False)
  ex = next(ds.as_numpy_iterator())
  first = synthetic.make_examples("validation", 1)[0]
  v = tasks.synthetic_vocabulary()
  n = len(first["targets"].split())
  expected_targets = v.encode(first["targets"]) + [1]
  assert list(ex["decoder_target_tokens"][:n + 1]) == expected_targets
  assert list(ex["decoder_input_tokens"][:n + 2]) == [0] + expected_targets
  assert ex["decoder_loss_weights"].sum() == n + 1
  assert list(ex["encoder_input_tokens"][:len(first["inputs"].split()) + 1]) \
      == v.encode(first["inputs"]) + [1]


def test_graded_task_prompts_differ_in_difficulty_and_show_it():
  """The graded variant's demonstrations score by level (easy high, hard
  low), each level's prompts use only its own words, and far more of the
  demonstrations' reward variance lies between levels."""
  graded = synthetic.make_examples("train", 3000, graded=True)
  plain = synthetic.make_examples("train", 3000)
  mean_by_level = {}
  for level, spec in enumerate(synthetic.GRADED_LEVELS):
    rows = [ex for ex in graded if ex["level"] == level]
    assert 800 < len(rows) < 1200  # equal shares
    for ex in rows:
      assert set(synthetic.prompt_words(ex["inputs"])) <= set(spec.words)
    mean_by_level[level] = np.mean([
        synthetic.gold_reward(ex["inputs"], ex["targets"]) for ex in rows])
  # The medium level has the plain task's mistake rates (its mean ~0.85).
  assert mean_by_level[0] > 0.95 and 0.8 < mean_by_level[1] < 0.9
  assert mean_by_level[2] < 0.65
  rewards = np.array([synthetic.gold_reward(ex["inputs"], ex["targets"])
                      for ex in graded])
  level_means = np.array([mean_by_level[ex["level"]] for ex in graded])
  assert level_means.var() / rewards.var() > 0.3
  # The plain task is unchanged by the option: same stream, no level.
  assert plain == synthetic.make_examples("train", 3000, graded=False)
  assert "level" not in plain[0]


def test_graded_task_is_registered_with_the_gold_reward():
  assert tasks.gold_reward_for(tasks.SYNTHETIC_SUMMARIZE_GRADED) is (
      synthetic.gold_reward)
  ds = seqio.get_dataset(
      tasks.SYNTHETIC_SUMMARIZE_GRADED, {"inputs": 16, "targets": 16},
      seqio.EncDecFeatureConverter(pack=False), dataset_split="test",
      shuffle=False)
  ex = next(ds.as_numpy_iterator())
  first = synthetic.make_examples("test", 1, graded=True)[0]
  v = tasks.synthetic_vocabulary()
  n = len(first["inputs"].split())
  assert list(ex["encoder_input_tokens"][:n + 1]) == (
      v.encode(first["inputs"]) + [1])
