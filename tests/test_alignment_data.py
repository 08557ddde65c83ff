"""Feature converters, alignment tasks through BatchIterator, synthetic labels.

Expected arrays are written out by hand from the synthetic vocabulary's
layout (pad 0, EOS 1, unk 2, then "summarize:" = 3 and the task's words in
order), not computed by the code under test.
"""

import json
import math

import numpy as np
import pytest
import seqio
import tensorflow as tf

from jaxrlhf.data import alignment_data
from jaxrlhf.data import feature_converters as fc
from jaxrlhf.data import pipeline
from jaxrlhf.data import synthetic
from jaxrlhf.data import synthetic_feedback
from jaxrlhf.data import tasks

WORD_IDS = {w: 3 + i for i, w in
            enumerate([synthetic.PROMPT_PREFIX] + synthetic.WORDS)}
PAD, EOS = 0, 1


def ids(text, eos=False):
  return [WORD_IDS[w] for w in text.split()] + ([EOS] if eos else [])


def convert(converter, examples, lengths, signature):
  ds = tf.data.Dataset.from_generator(lambda: iter(examples),
                                      output_signature=signature)
  out = converter(ds, lengths)
  return [{k: np.asarray(v) for k, v in ex.items()}
          for ex in out.as_numpy_iterator()]


TOKENS = tf.TensorSpec([None], tf.int32)
SCALAR = tf.TensorSpec([], tf.float32)
PAIR_SIGNATURE = {"prompt": TOKENS, "chosen": TOKENS, "rejected": TOKENS,
                  "margin": SCALAR, "confidence": SCALAR}
PAIR_EXAMPLE = {
    "prompt": np.array([3, 10, 4, 1], np.int32),   # summarize: fox red EOS
    "chosen": np.array([10, 4, 1], np.int32),      # fox red EOS
    "rejected": np.array([10, 1], np.int32),       # fox EOS
    "margin": np.float32(0.5), "confidence": np.float32(0.75)}


# --- encoder-decoder ---------------------------------------------------------


def test_encdec_pairs_shift_right_and_loss_weights():
  [ex] = convert(fc.EncDecPairsFeatureConverter(), [PAIR_EXAMPLE],
                 {"prompt": 6, "chosen": 4, "rejected": 4}, PAIR_SIGNATURE)
  expected = {
      "encoder_input_tokens": [3, 10, 4, 1, 0, 0],
      "chosen_decoder_target_tokens": [10, 4, 1, 0],
      "chosen_decoder_input_tokens": [0, 10, 4, 1],
      "chosen_decoder_loss_weights": [1, 1, 1, 0],
      "rejected_decoder_target_tokens": [10, 1, 0, 0],
      "rejected_decoder_input_tokens": [0, 10, 1, 0],
      "rejected_decoder_loss_weights": [1, 1, 0, 0],
  }
  assert set(ex) == set(expected) | {"margin", "confidence", "prompt_weight",
                                     "annotation_batch"}
  for name, want in expected.items():
    np.testing.assert_array_equal(ex[name], want, err_msg=name)
    assert ex[name].dtype == np.int32
  assert ex["margin"].dtype == np.float32 and ex["margin"] == 0.5
  assert ex["confidence"] == 0.75


def test_encdec_trajectory_and_thumbs_scalars():
  signature = {"prompt": TOKENS, "completion": TOKENS, "reward": SCALAR}
  example = {"prompt": np.array([3, 11, 1], np.int32),
             "completion": np.array([11, 1], np.int32),
             "reward": np.float32(-1.25)}
  [ex] = convert(fc.EncDecTrajectoryFeatureConverter(), [example],
                 {"prompt": 4, "completion": 3}, signature)
  np.testing.assert_array_equal(ex["completion_decoder_target_tokens"],
                                [11, 1, 0])
  np.testing.assert_array_equal(ex["completion_decoder_input_tokens"],
                                [0, 11, 1])
  assert ex["reward"] == np.float32(-1.25) and ex["reward"].dtype == np.float32

  signature = {"prompt": TOKENS, "completion": TOKENS,
               "label": tf.TensorSpec([], tf.int32)}
  example = {"prompt": np.array([3, 11, 1], np.int32),
             "completion": np.array([11, 1], np.int32), "label": np.int32(1)}
  [ex] = convert(alignment_data.feature_converter_for(
      "thumbs", "encoder_decoder"), [example],
                 {"prompt": 4, "completion": 3}, signature)
  assert ex["label"].dtype == np.float32 and ex["label"] == 1.0


def test_converter_without_the_kinds_scalar_says_so():
  ds = tf.data.Dataset.from_tensors({"prompt": [3, 1], "completion": [4, 1]})
  with pytest.raises(ValueError, match="no 'reward' feature"):
    fc.EncDecTrajectoryFeatureConverter()(ds, {"prompt": 4, "completion": 4})


def test_packing_in_the_converter_is_refused_pointing_to_the_packer():
  with pytest.raises(ValueError, match="one example per row; pack several "
                     "per row after it with feature_converters.Packer"):
    fc.EncDecPairsFeatureConverter(pack=True)


# --- decoder-only ------------------------------------------------------------


def test_decoder_pairs_right_padded_sequences_and_left_padded_prompt():
  [ex] = convert(fc.DecoderPairsFeatureConverter(), [PAIR_EXAMPLE],
                 {"prompt": 6, "chosen": 4, "rejected": 3}, PAIR_SIGNATURE)
  # The prompt's EOS is dropped: EOS only ends completions, PAD (0) differs.
  # The task's prompt length (6) counts that EOS: 5 prompt slots.
  expected = {
      "chosen_tokens":          [3, 10, 4, 10, 4, 1, 0, 0, 0],
      "chosen_loss_weights":    [0, 0, 0, 1, 1, 1, 0, 0, 0],
      "chosen_positions":       [0, 1, 2, 3, 4, 5, 0, 0, 0],
      "chosen_attention_mask":  [1, 1, 1, 1, 1, 1, 0, 0, 0],
      "rejected_tokens":         [3, 10, 4, 10, 1, 0, 0, 0],
      "rejected_loss_weights":   [0, 0, 0, 1, 1, 0, 0, 0],
      "rejected_positions":      [0, 1, 2, 3, 4, 0, 0, 0],
      "rejected_attention_mask": [1, 1, 1, 1, 1, 0, 0, 0],
      "prompt_tokens":          [0, 0, 3, 10, 4],
      "prompt_attention_mask":  [0, 0, 1, 1, 1],
      "prompt_positions":       [0, 0, 0, 1, 2],
  }
  assert set(ex) == set(expected) | {"margin", "confidence", "prompt_weight",
                                     "annotation_batch"}
  for name, want in expected.items():
    np.testing.assert_array_equal(ex[name], want, err_msg=name)


def test_decoder_keeps_prompt_eos_when_asked_and_prepends_bos():
  converter = fc.DecoderTrajectoryFeatureConverter(strip_prompt_eos=False,
                                                   prompt_bos_id=2)
  signature = {"prompt": TOKENS, "completion": TOKENS, "reward": SCALAR}
  example = {"prompt": np.array([3, 11, 1], np.int32),
             "completion": np.array([11, 1], np.int32),
             "reward": np.float32(0.0)}
  [ex] = convert(converter, [example], {"prompt": 3, "completion": 2},
                 signature)
  np.testing.assert_array_equal(ex["completion_tokens"],
                                [2, 3, 11, 1, 11, 1])
  np.testing.assert_array_equal(ex["completion_loss_weights"],
                                [0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(ex["prompt_tokens"], [2, 3, 11, 1])
  np.testing.assert_array_equal(ex["prompt_positions"], [0, 1, 2, 3])


# --- rankings ----------------------------------------------------------------


RANK_SIGNATURE = {"prompt": TOKENS,
                  "completions": tf.RaggedTensorSpec([None, None], tf.int32,
                                                     ragged_rank=1)}


def ranking_example(prompt, completions):
  return {"prompt": np.array(prompt, np.int32),
          "completions": tf.ragged.constant(completions, dtype=tf.int32)}


def test_encdec_ranking_pads_rows_and_masks_missing_ones():
  example = ranking_example([3, 10, 1], [[10, 1], [4, 10, 1]])
  [ex] = convert(fc.EncDecRankingFeatureConverter(num_completions=3),
                 [example], {"prompt": 4, "completions": 4}, RANK_SIGNATURE)
  np.testing.assert_array_equal(ex["completions_mask"], [1, 1, 0])
  np.testing.assert_array_equal(ex["completions_decoder_target_tokens"],
                                [[10, 1, 0, 0], [4, 10, 1, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(ex["completions_decoder_input_tokens"],
                                [[0, 10, 1, 0], [0, 4, 10, 1], [0, 0, 0, 0]])
  np.testing.assert_array_equal(ex["completions_decoder_loss_weights"],
                                [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(ex["encoder_input_tokens"], [3, 10, 1, 0])


def test_decoder_ranking_rows():
  example = ranking_example([3, 10, 1], [[10, 1], [4, 1]])
  [ex] = convert(fc.DecoderRankingFeatureConverter(num_completions=3),
                 [example], {"prompt": 4, "completions": 3}, RANK_SIGNATURE)
  np.testing.assert_array_equal(ex["completions_tokens"],
                                [[3, 10, 10, 1, 0, 0], [3, 10, 4, 1, 0, 0],
                                 [0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(ex["completions_loss_weights"],
                                [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0],
                                 [0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(ex["completions_positions"],
                                [[0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 0, 0],
                                 [0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(ex["completions_mask"], [1, 1, 0])
  np.testing.assert_array_equal(ex["prompt_tokens"], [0, 3, 10])


def test_ranking_with_more_completions_than_k_fails_instead_of_cutting():
  example = ranking_example([3, 1], [[10, 1], [4, 1], [5, 1]])
  with pytest.raises(tf.errors.InvalidArgumentError, match="more completions"):
    convert(fc.EncDecRankingFeatureConverter(num_completions=2), [example],
            {"prompt": 2, "completions": 3}, RANK_SIGNATURE)
  with pytest.raises(ValueError, match="num_completions=5 exceeds"):
    convert(fc.EncDecRankingFeatureConverter(num_completions=5), [example],
            {"prompt": 2, "completions": 3}, RANK_SIGNATURE)


# --- a file task through BatchIterator ----------------------------------------


def test_file_task_through_batch_iterator(tmp_path):
  rows = [
      {"q": "summarize: fox red fox", "good": "fox red", "bad": "fox",
       "gap": 2},
      {"q": "summarize: owl", "good": "owl", "bad": "owl owl cat"},
      {"q": "summarize: sun moon", "good": "sun moon", "bad": "sun"},
  ]
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  alignment_data.register_file_task(
      "test_alignment_pairs_file", str(path), kind="pairs",
      vocabulary=tasks.synthetic_vocabulary(),
      column_mapping={"prompt": "q", "chosen": "good", "rejected": "bad",
                      "margin": "gap"},
      max_prompt_tokens=6, overwrite=True)
  lengths = {"prompt": 6, "chosen": 4, "rejected": 4}
  batches = pipeline.BatchIterator(
      "test_alignment_pairs_file", "train", lengths,
      alignment_data.feature_converter_for("pairs", "encoder_decoder"),
      global_batch_size=2, seed=0, shuffle=False, num_epochs=1)
  batch = next(batches)
  np.testing.assert_array_equal(batch["encoder_input_tokens"], [
      ids("summarize: fox red fox", eos=True) + [0],
      ids("summarize: owl", eos=True) + [0, 0, 0]])
  np.testing.assert_array_equal(batch["chosen_decoder_target_tokens"], [
      ids("fox red", eos=True) + [0], ids("owl", eos=True) + [0, 0]])
  np.testing.assert_array_equal(batch["rejected_decoder_input_tokens"], [
      [0] + ids("fox", eos=True) + [0], [0] + ids("owl owl cat")])
  np.testing.assert_array_equal(batch["rejected_decoder_loss_weights"], [
      [1, 1, 0, 0], [1, 1, 1, 1]])
  np.testing.assert_array_equal(batch["margin"], [2.0, 0.0])
  np.testing.assert_array_equal(batch["confidence"], [1.0, 1.0])
  assert batches.position == 1
  with pytest.raises(StopIteration):  # 3 examples make one batch of 2.
    next(batches)

  decoder_batch = next(pipeline.BatchIterator(
      "test_alignment_pairs_file", "train", lengths,
      alignment_data.feature_converter_for("pairs", "decoder_only"),
      global_batch_size=3, seed=0, shuffle=False, num_epochs=1))
  # The task's prompt length counts the EOS a decoder-only prompt drops:
  # 6 -> prompts of up to 5 tokens, left-padded.
  np.testing.assert_array_equal(decoder_batch["prompt_tokens"][2],
                                [0, 0] + ids("summarize: sun moon"))
  np.testing.assert_array_equal(decoder_batch["chosen_tokens"][2],
                                ids("summarize: sun moon sun moon", eos=True)
                                + [0] * 3)

  # A prompt feature shorter than the source's limit would cut prompts.
  with pytest.raises(ValueError, match="truncated silently"):
    pipeline.BatchIterator(
        "test_alignment_pairs_file", "train", {**lengths, "prompt": 4},
        alignment_data.feature_converter_for("pairs", "encoder_decoder"),
        global_batch_size=2, seed=0)


def test_ranking_file_task_through_batch_iterator(tmp_path):
  path = tmp_path / "ranking.jsonl"
  path.write_text(json.dumps({"prompt": "summarize: fox owl",
                              "completions": ["fox owl", "owl", "cat"]}) + "\n"
                  + json.dumps({"prompt": "summarize: red",
                                "completions": ["red", "blue"]}) + "\n")
  alignment_data.register_file_task(
      "test_alignment_ranking_file", str(path), kind="ranking",
      vocabulary=tasks.synthetic_vocabulary(), overwrite=True)
  batch = next(pipeline.BatchIterator(
      "test_alignment_ranking_file", "train", {"prompt": 4, "completions": 3},
      alignment_data.feature_converter_for("ranking", "encoder_decoder",
                                           num_completions=3),
      global_batch_size=2, seed=0, shuffle=False))
  np.testing.assert_array_equal(batch["completions_mask"],
                                [[1, 1, 1], [1, 1, 0]])
  np.testing.assert_array_equal(batch["completions_decoder_target_tokens"][1],
                                [ids("red", eos=True) + [0],
                                 ids("blue", eos=True) + [0], [0, 0, 0]])


def test_register_twice_needs_overwrite(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text(json.dumps({"prompt": "summarize: red", "completion": "red",
                              "reward": 1.0}) + "\n")
  kwargs = dict(kind="trajectory", vocabulary=tasks.synthetic_vocabulary())
  alignment_data.register_file_task("test_alignment_twice", str(path),
                                    overwrite=True, **kwargs)
  with pytest.raises(ValueError, match="already registered"):
    alignment_data.register_file_task("test_alignment_twice", str(path),
                                      **kwargs)


def test_custom_pairs_source_may_leave_out_the_optional_scalars():
  """A source with only prompt/chosen/rejected gets margin 0, confidence 1
  and prompt_weight 1 (the kind's defaults); a trajectory source without its
  required reward is refused by seqio."""
  def source(**texts):
    def dataset_fn(split, shuffle_files, seed=None):
      del split, shuffle_files, seed
      return tf.data.Dataset.from_tensor_slices(
          {k: [v] for k, v in texts.items()})
    return seqio.FunctionDataSource(dataset_fn, splits=("train",))
  vocabulary = tasks.synthetic_vocabulary()
  alignment_data.register_alignment_task(
      "test_custom_pairs_defaults",
      source(prompt="summarize: fox red", chosen="fox red", rejected="fox"),
      "pairs", vocabulary,
      overwrite=True)
  rows = list(seqio.get_dataset(
      "test_custom_pairs_defaults", {"prompt": 8, "chosen": 6, "rejected": 6},
      fc.feature_converter_for("pairs", "encoder_decoder"),
      dataset_split="train", shuffle=False).as_numpy_iterator())
  assert len(rows) == 1
  assert (rows[0]["margin"], rows[0]["confidence"],
          rows[0]["prompt_weight"]) == (0.0, 1.0, 1.0)
  assert list(rows[0]["chosen_decoder_target_tokens"][:3]) == [
      WORD_IDS["fox"], WORD_IDS["red"], EOS]

  alignment_data.register_alignment_task(
      "test_custom_trajectory_no_reward",
      source(prompt="summarize: fox red", completion="fox red"),
      "trajectory", vocabulary,
      overwrite=True)
  with pytest.raises(Exception, match="reward"):
    list(seqio.get_dataset(
        "test_custom_trajectory_no_reward", {"prompt": 8, "completion": 6},
        fc.feature_converter_for("trajectory", "encoder_decoder"),
        dataset_split="train", shuffle=False).as_numpy_iterator())


# --- synthetic feedback ------------------------------------------------------

PROMPT = "summarize: fox red owl"
# Gold rewards by hand (F1 over distinct prompt words): all three words 1.0;
# two of three: recall 2/3, precision 1 -> 0.8; one: 0.5; none: 0.
HAND_REWARDS = {"fox red owl": 1.0, "fox red": 0.8, "fox": 0.5, "cat": 0.0}


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def test_bradley_terry_frequencies_match_sigmoid_of_reward_gap():
  beta, n = 3.0, 2000
  texts = list(HAND_REWARDS)
  rows = synthetic_feedback.label_pairs(
      [PROMPT] * n, [texts] * n, synthetic.gold_reward, beta=beta, seed=7)
  assert len(rows) == n * 6
  for r in rows[:6]:
    assert r["chosen_gold_reward"] == pytest.approx(HAND_REWARDS[r["chosen"]])
  for i, a in enumerate(texts):
    for b in texts[i + 1:]:
      shown = [r for r in rows if {r["chosen"], r["rejected"]} == {a, b}]
      assert len(shown) == n
      freq = np.mean([r["chosen"] == a for r in shown])
      p = sigmoid(beta * (HAND_REWARDS[a] - HAND_REWARDS[b]))
      assert abs(freq - p) < 4.5 * math.sqrt(p * (1 - p) / n), (a, b, freq, p)
  again = synthetic_feedback.label_pairs(
      [PROMPT] * n, [texts] * n, synthetic.gold_reward, beta=beta, seed=7)
  assert again == rows


def test_noiseless_annotator_and_ties():
  rows = synthetic_feedback.label_pairs(
      [PROMPT] * 400, [["fox red", "fox", "red fox", "red"]] * 400,
      synthetic.gold_reward, beta=math.inf, seed=1)
  for r in rows:
    assert r["chosen_gold_reward"] >= r["rejected_gold_reward"]
  tie = [r["chosen"] == "fox red" for r in rows
         if {r["chosen"], r["rejected"]} == {"fox red", "red fox"}]
  assert len(tie) == 400 and abs(np.mean(tie) - 0.5) < 4.5 * 0.5 / 20


def test_plackett_luce_top_choice_frequencies():
  beta, n = 2.0, 3000
  texts = ["fox red owl", "fox", "cat"]
  rows = synthetic_feedback.label_rankings(
      [PROMPT] * n, [texts] * n, synthetic.gold_reward, beta=beta, seed=3)
  weights = np.exp(beta * np.array([1.0, 0.5, 0.0]))
  p_top = weights / weights.sum()
  for text, p in zip(texts, p_top):
    freq = np.mean([r["completions"][0] == text for r in rows])
    assert abs(freq - p) < 4.5 * math.sqrt(p * (1 - p) / n), (text, freq, p)


def test_synthetic_files_read_back_through_the_file_sources(tmp_path):
  prompts = [PROMPT, "summarize: cat dog"]
  completions = [["fox red owl", "fox", "cat"], ["cat dog", "dog dog"]]
  pairs_path = str(tmp_path / "pairs.jsonl")
  traj_path = str(tmp_path / "traj.jsonl")
  assert synthetic_feedback.write_synthetic_feedback(
      pairs_path, "pairs", prompts, completions, synthetic.gold_reward,
      beta=math.inf, seed=0) == 4
  synthetic_feedback.write_synthetic_feedback(
      traj_path, "trajectory", prompts, completions, synthetic.gold_reward)
  vocab = tasks.synthetic_vocabulary()
  pairs = alignment_data.AlignmentFileSource(
      pairs_path, kind="pairs", vocabulary=vocab).examples()
  assert [(p["chosen"], p["rejected"]) for p in pairs] == [
      ("fox red owl", "fox"), ("fox red owl", "cat"), ("fox", "cat"),
      ("cat dog", "dog dog")]
  trajectories = alignment_data.AlignmentFileSource(
      traj_path, kind="trajectory", vocabulary=vocab).examples()
  # "dog dog" for "cat dog": recall 1/2, precision 1/2 -> F1 0.5.
  assert [t["reward"] for t in trajectories] == pytest.approx(
      [1.0, 0.5, 0.0, 1.0, 0.5])
