"""Reward models weigh every prompt once (InstructGPT) and are normalised so
the SFT reference completions score mean 0 (PPO details, detail 15).

Truths used: weights worked out by hand for prompts with 1, 2 and 3 pairs; a
plain-Python loss that averages each prompt's pairs first and then the
prompts; reference rewards scored through seqio's own EncDecFeatureConverter
(not the algorithm's feature path) with the saved parameters.
"""

import functools
import json
import math
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
import seqio

from conftest import from_scratch, tiny_config, trainer_of
from jaxrlhf import sharding
from jaxrlhf.data import alignment_data
from jaxrlhf.data import file_sources
from jaxrlhf.data import synthetic
from jaxrlhf.losses import reward_model_losses
from jaxrlhf.models import heads
from jaxrlhf.models import pretrained
from jaxrlhf.algorithms.offline import reward_model
from jaxrlhf.train import loop

NORMALIZE_TASK = "synthetic_summarize"
NUM_REFERENCES = 32


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return str(path)


# Prompts "a" (3 pairs), "b" (1 pair) and "c" (2 pairs), interleaved.
UNEVEN_ROWS = [
    {"prompt": "a", "chosen": "a1", "rejected": "a2"},
    {"prompt": "b", "chosen": "b1", "rejected": "b2"},
    {"prompt": "a", "chosen": "a1", "rejected": "a3"},
    {"prompt": "c", "chosen": "c1", "rejected": "c2"},
    {"prompt": "a", "chosen": "a2", "rejected": "a3"},
    {"prompt": "c", "chosen": "c2", "rejected": "c3"},
]
# 6 pairs over 3 prompts: w = (6 / 3) / (pairs of the prompt).
UNEVEN_WEIGHTS = [2 / 3, 2.0, 2 / 3, 1.0, 2 / 3, 1.0]


def _per_prompt_mean_loss(prompts, chosen, rejected):
  """Plain Python: each prompt's mean -log sigmoid(r_c - r_r), then the
  mean over prompts."""
  by_prompt = {}
  for p, c, r in zip(prompts, chosen, rejected):
    by_prompt.setdefault(p, []).append(math.log1p(math.exp(-(c - r))))
  return sum(sum(v) / len(v) for v in by_prompt.values()) / len(by_prompt)


def test_file_source_weights_prompts_with_1_2_and_3_pairs(tmp_path):
  path = _write_jsonl(tmp_path / "pairs.jsonl", UNEVEN_ROWS)
  source = file_sources.AlignmentFileSource(path, kind="pairs")
  examples = source.examples("train")
  np.testing.assert_allclose([e["prompt_weight"] for e in examples],
                             UNEVEN_WEIGHTS, rtol=1e-12)
  # Each prompt's pairs weigh the same in total.
  for prompt in "abc":
    total = sum(e["prompt_weight"] for e in examples if e["prompt"] == prompt)
    np.testing.assert_allclose(total, 2.0, rtol=1e-12)

  # Switched off, the file's own column (or 1) is kept.
  rows = [dict(r, prompt_weight=0.5) for r in UNEVEN_ROWS[:2]] + UNEVEN_ROWS[2:]
  path = _write_jsonl(tmp_path / "own.jsonl", rows)
  own = file_sources.AlignmentFileSource(path, kind="pairs",
                                         prompt_weights=False)
  assert [e["prompt_weight"] for e in own.examples()] == [0.5, 0.5] + [1.0] * 4


def test_weights_count_only_the_pairs_kept(tmp_path):
  # A bad pair of prompt "a" is skipped, so "a" has 2 usable pairs.
  rows = UNEVEN_ROWS[:4] + [{"prompt": "a", "chosen": "", "rejected": "x"}]
  path = _write_jsonl(tmp_path / "pairs.jsonl", rows)
  source = file_sources.AlignmentFileSource(path, kind="pairs",
                                            on_bad_row="skip_and_report")
  examples = source.examples()
  assert source.bad_row_counts() == {"empty_completion": 1}
  # 4 pairs over 3 prompts: a: (4/3)/2 each, b: 4/3, c: 4/3.
  np.testing.assert_allclose([e["prompt_weight"] for e in examples],
                             [2 / 3, 4 / 3, 2 / 3, 4 / 3], rtol=1e-12)


def test_weights_reach_the_batches(tmp_path):
  path = _write_jsonl(tmp_path / "pairs.jsonl", UNEVEN_ROWS)
  alignment_data.register_file_task(
      "weighting_pairs", path, kind="pairs",
      vocabulary=seqio.ByteVocabulary(), overwrite=True)
  ds = seqio.get_dataset(
      "weighting_pairs", {"prompt": 8, "chosen": 8, "rejected": 8},
      alignment_data.feature_converter_for("pairs", "encoder_decoder"),
      dataset_split="train", shuffle=False, num_epochs=1)
  weights = [float(ex["prompt_weight"]) for ex in ds.as_numpy_iterator()]
  np.testing.assert_allclose(weights, UNEVEN_WEIGHTS, rtol=1e-6)


def test_weighted_loss_is_the_mean_over_prompts_of_per_prompt_means():
  rng = np.random.default_rng(0)
  prompts = [r["prompt"] for r in UNEVEN_ROWS]
  chosen = rng.normal(size=len(prompts)).astype(np.float32)
  rejected = rng.normal(size=len(prompts)).astype(np.float32)
  expected = _per_prompt_mean_loss(prompts, chosen, rejected)
  weights = file_sources.equal_prompt_weights(prompts).astype(np.float32)
  loss, _ = reward_model_losses.bradley_terry_loss(chosen, rejected,
                                                   weights=weights)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  # The unweighted mean differs here (prompt "a" would count 3 times).
  plain, _ = reward_model_losses.bradley_terry_loss(chosen, rejected)
  assert abs(float(plain) - expected) > 1e-3


# --- the algorithm --------------------------------------------------------------

REWARD_MODEL = from_scratch(reward_model.ALGORITHM)


def _synthetic_pair_rows(num_prompts):
  """Prompts with 1, 2 or 3 pairs (ideal summary vs. worse ones)."""
  rows = []
  for i, e in enumerate(synthetic.make_examples("train", num_prompts)):
    foreign = next(w for w in synthetic.WORDS if w not in e["ideal"].split())
    worse = [f"{e['ideal']} {foreign}", foreign, e["ideal"].split()[0]]
    for rejected in worse[:1 + i % 3]:
      rows.append({"prompt": e["inputs"], "chosen": e["ideal"],
                   "rejected": rejected})
  return rows


def _config(tmp_path, **overrides):
  path = _write_jsonl(tmp_path / "rm_pairs.jsonl", _synthetic_pair_rows(24))
  config = tiny_config(algorithm="reward_model", data__task="rm_weighting",
                       optimizer__warmup_steps=0, **overrides)
  config.data.files.train = path
  with config.unlocked():
    config.reward_model.normalize_on_task = NORMALIZE_TASK
    config.reward_model.normalize_num_examples = NUM_REFERENCES
  return config


@pytest.fixture(scope="module")
def trainer_and_mesh(tmp_path_factory):
  config = _config(tmp_path_factory.mktemp("rm"))
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(REWARD_MODEL, config, mesh)
  return trainer, mesh, rules


def _all_pairs_batch(trainer):
  """Every pair of the training file, in file order, as one batch."""
  ds = seqio.get_dataset(trainer.config.data.task, trainer.feature_lengths,
                         trainer.feature_converter, dataset_split="train",
                         shuffle=False, num_epochs=1)
  rows = list(ds.as_numpy_iterator())
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _reference_features(num):
  """Prompts and reference targets of the normalisation task through seqio's
  own encoder-decoder converter (unprefixed feature names)."""
  ds = seqio.get_dataset(NORMALIZE_TASK, {"inputs": 16, "targets": 16},
                         seqio.EncDecFeatureConverter(pack=False),
                         dataset_split="train", shuffle=False, num_epochs=1)
  rows = list(ds.take(num).as_numpy_iterator())
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


@functools.lru_cache(maxsize=None)
def _loss_and_pair_rewards(trainer):
  """One compilation for both: the algorithm's loss and the rewards it saw."""
  return jax.jit(lambda params, frozen, b: (
      reward_model.pairs_loss(trainer, params, frozen, b, None),
      reward_model.pair_rewards(trainer.lm, params["reward"], b)))


@functools.lru_cache(maxsize=None)
def _reference_scorer(trainer):
  return jax.jit(lambda p, b: heads.sequence_rewards(trainer.lm, p, b))


def _reference_mean(trainer, reward_params):
  features = _reference_features(NUM_REFERENCES)
  rewards = _reference_scorer(trainer)(reward_params, features)
  return float(np.mean(np.asarray(rewards, np.float64)))


def test_reward_model_loss_weighs_prompts_equally(trainer_and_mesh):
  trainer, mesh, rules = trainer_and_mesh
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = trainer.init_state()
    batch = _all_pairs_batch(trainer)
    (loss, _), (chosen, rejected) = _loss_and_pair_rewards(trainer)(
        state.params, state.frozen, batch)
  prompts = [tuple(p) for p in batch["encoder_input_tokens"]]
  assert sorted(np.unique(np.unique(prompts, axis=0, return_counts=True)[1])
                ) == [1, 2, 3]
  expected = _per_prompt_mean_loss(prompts, np.asarray(chosen),
                                   np.asarray(rejected))
  np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_normalisation_centres_reference_rewards_and_keeps_differences(
    trainer_and_mesh):
  trainer, mesh, rules = trainer_and_mesh
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = trainer.init_state()
    # Start far from mean 0 whatever the initial head gives.
    state = state.replace(params=dict(
        state.params, reward=heads.shift_bias(state.params["reward"], 3.0)))
    batch = _all_pairs_batch(trainer)
    pair_rewards = lambda s: map(np.asarray, _loss_and_pair_rewards(trainer)(
        s.params, s.frozen, batch)[1])
    chosen, rejected = pair_rewards(state)
    before = _reference_mean(trainer, state.params["reward"])
    state, info = reward_model.normalize_reward_bias(trainer, state)
    chosen_after, rejected_after = pair_rewards(state)
    after = _reference_mean(trainer, state.params["reward"])
  assert abs(before) > 1.0
  np.testing.assert_allclose(info["reward_normalization/mean_before"], before,
                             rtol=1e-4)
  assert abs(after) < 1e-4
  assert abs(info["reward_normalization/mean_after"]) < 1e-4
  assert info["reward_normalization/num_examples"] == NUM_REFERENCES
  # Every reward moved by the same amount: differences and accuracy stay.
  np.testing.assert_allclose(chosen_after - chosen, -before, atol=1e-4)
  np.testing.assert_allclose(chosen_after - rejected_after, chosen - rejected,
                             atol=1e-5)
  np.testing.assert_array_equal(chosen_after > rejected_after,
                                chosen > rejected)


def test_reward_model_run_saves_normalised_head(tmp_path, trainer_and_mesh):
  trainer, mesh, rules = trainer_and_mesh
  config = _config(tmp_path, train__num_steps=3)
  workdir = str(tmp_path / "run")
  loop.train(config, workdir)
  rows = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
  [last] = [r for r in rows if "reward_normalization/mean_before" in r]
  assert last["step"] == 3
  assert abs(last["reward_normalization/mean_after"]) < 1e-4
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    target = trainer.init_state().params["reward"]
    saved = pretrained.load_network_params(workdir, target, "reward")
    np.testing.assert_allclose(_reference_mean(trainer, saved), 0.0,
                               atol=1e-4)
  # The normalised state is the run's one final checkpoint (no extra step).
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]


def test_evaluation_scores_every_eval_pair(tmp_path):
  """eval/accuracy and eval/loss over 40 pairs (eval batches of 16, the last
  one padded) equal plain Python over rewards scored one by one from
  features laid out by hand."""
  config = _config(tmp_path, data__eval_split="train", eval__num_examples=40,
                   eval__batch_size=16)
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = trainer_of(REWARD_MODEL, config, mesh)
    state = trainer.init_state()
    metrics = trainer.evaluate(state)
    params = jax.device_get(state.params["reward"])
  vocabulary, eos = trainer.vocabulary, trainer.vocabulary.eos_id
  lp, lc = config.data.inputs_length, config.data.targets_length

  def padded(ids, length):
    return np.pad(ids, (0, length - len(ids)))[None]

  def reward(prompt, completion):
    target = list(vocabulary.encode(completion)) + [eos]
    features = {
        "encoder_input_tokens": padded(
            list(vocabulary.encode(prompt)) + [eos], lp),
        "decoder_target_tokens": padded(target, lc),
        "decoder_input_tokens": padded([0] + target[:-1], lc),
        "decoder_loss_weights": padded([1] * len(target), lc)}
    return float(_reference_scorer(trainer)(params, features)[0])

  rows = _synthetic_pair_rows(24)[:40]
  margins = np.array([reward(r["prompt"], r["chosen"])
                      - reward(r["prompt"], r["rejected"]) for r in rows])
  np.testing.assert_allclose(metrics["eval/accuracy"], np.mean(margins > 0))
  np.testing.assert_allclose(metrics["eval/loss"],
                             np.mean(np.log1p(np.exp(-margins))), rtol=1e-4)
  np.testing.assert_allclose(metrics["eval/margin"], np.mean(margins),
                             rtol=1e-4, atol=1e-6)


def test_unknown_normalisation_task_names_the_field(tmp_path):
  config = _config(tmp_path)
  config.reward_model.normalize_on_task = "no_such_task"
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    with pytest.raises(ValueError,
                       match="config.reward_model.normalize_on_task"):
      trainer_of(REWARD_MODEL, config, mesh)
