"""SFT and KTO for decoder-only (Llama) policies.

Expected features are written out by hand (synthetic vocabulary: PAD 0,
EOS 1, "summarize:" 3, then words); the SFT loss is checked against a numpy
computation on each example's unpadded sequence, and KTO's mismatched
sequences against the converter run on the mismatched examples themselves.
"""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
import seqio
import tensorflow as tf

from conftest import from_scratch, trainer_of, tiny_config
from jaxrlhf import sharding
from jaxrlhf.data import feature_converters as fc
from jaxrlhf.data import synthetic
from jaxrlhf.data import synthetic_feedback
from jaxrlhf import algorithms
from jaxrlhf.algorithms.offline import kto
from jaxrlhf.train import loop

TOKENS = tf.TensorSpec([None], tf.int32)
SFT_SIGNATURE = {"inputs": TOKENS, "targets": TOKENS}
LLAMA = dict(model__arch="llama", model__size="tiny",
             model__num_encoder_layers=None)


def convert(converter, examples, lengths, signature):
  ds = tf.data.Dataset.from_generator(lambda: iter(examples),
                                      output_signature=signature)
  return [{k: np.asarray(v) for k, v in ex.items()}
          for ex in converter(ds, lengths).as_numpy_iterator()]


def sft_example(inputs, targets):
  return {"inputs": np.array(inputs, np.int32),
          "targets": np.array(targets, np.int32)}


def one_device_mesh():
  return sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])


# --- SFT features ------------------------------------------------------------


def test_sft_converter_concatenates_prompt_and_target_with_loss_on_target():
  [ex] = convert(fc.sft_feature_converter("decoder_only"),
                 [sft_example([3, 10, 4, 1], [11, 12, 1])],
                 {"inputs": 6, "targets": 4}, SFT_SIGNATURE)
  # The prompt's EOS is dropped (the task's inputs length, 6, counts it: 5
  # prompt slots); the target's EOS is kept and weighted.
  expected = {
      "tokens":                [3, 10, 4, 11, 12, 1, 0, 0, 0],
      "loss_weights":          [0, 0, 0, 1, 1, 1, 0, 0, 0],
      "positions":             [0, 1, 2, 3, 4, 5, 0, 0, 0],
      "attention_mask":        [1, 1, 1, 1, 1, 1, 0, 0, 0],
      "prompt_tokens":         [0, 0, 3, 10, 4],
      "prompt_attention_mask": [0, 0, 1, 1, 1],
      "prompt_positions":      [0, 0, 0, 1, 2],
  }
  assert set(ex) == set(expected)
  for name, want in expected.items():
    np.testing.assert_array_equal(ex[name], want, err_msg=name)
    assert ex[name].dtype == np.int32


def test_sft_converter_for_t5_is_seqios_and_bad_arguments_are_named():
  assert isinstance(fc.sft_feature_converter("encoder_decoder"),
                    seqio.EncDecFeatureConverter)
  with pytest.raises(ValueError, match="only apply to decoder-only"):
    fc.sft_feature_converter("encoder_decoder", eos_id=2)
  with pytest.raises(ValueError, match="unknown architecture 'rnn'"):
    fc.sft_feature_converter("rnn")


# --- SFT loss ---------------------------------------------------------------

# (inputs with EOS, targets with EOS), as the synthetic task makes them.
SFT_ROWS = [([3, 10, 4, 1], [10, 4, 1]),
            ([3, 11, 1], [12, 13, 14, 1]),
            ([3, 5, 6, 7, 8, 1], [1]),
            ([3, 9, 1], [9, 9, 1])]


def _log_softmax(x):
  x = x.astype(np.float64)
  log_z = np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1)) + x.max(-1)
  return x - log_z[..., None], log_z


def _reference_sft_loss(model, params, z_loss):
  """-mean over target tokens of log p(token | prompt, earlier targets),
  each example run alone without padding; and that plus z_loss * log Z^2."""
  nll = z_total = count = 0.0
  for inputs, targets in SFT_ROWS:
    sequence = inputs[:-1] + targets   # the prompt's EOS is not read
    n = len(sequence)
    logits = np.asarray(model.apply(
        {"params": params}, np.array([sequence], np.int32),
        np.arange(n, dtype=np.int32)[None], np.ones((1, n), np.int32)))[0]
    logprobs, log_z = _log_softmax(logits)
    for t in range(len(inputs) - 1, n):  # each target token, EOS included
      nll -= logprobs[t - 1, sequence[t]]
      z_total += z_loss * log_z[t - 1] ** 2
      count += 1
  return nll / count, (nll + z_total) / count


def test_decoder_only_sft_loss_equals_numpy_reference():
  # Two micro-batches: the step's loss must still be the whole batch's mean.
  z_loss = 1e-2
  config = tiny_config(**LLAMA, train__z_loss=z_loss,
                       train__num_microbatches=2)
  mesh = one_device_mesh()
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  rows = convert(fc.sft_feature_converter("decoder_only"),
                 [sft_example(i, t) for i, t in SFT_ROWS],
                 {"inputs": 6, "targets": 4}, SFT_SIGNATURE)
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = algorithms.build(config, mesh)
    assert not trainer.lm.is_encoder_decoder
    state = trainer.init_state()
    params = jax.device_get(nn.meta.unbox(state.params["policy"]))
    want_nll, want_loss = _reference_sft_loss(trainer.model, params, z_loss)
    _, metrics = trainer.train_step(state,
                                    sharding.global_batch(batch, mesh, rules))
  assert want_loss > want_nll  # the z-loss term is there
  np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["nll"]), want_nll, rtol=1e-5)


# Every decoder-only family trains through the same common signature.
@pytest.mark.parametrize("arch", ["llama", "t5x_decoder_only", "gemma"])
def test_tiny_decoder_only_sft_run_lowers_loss_and_is_evaluated(tmp_path,
                                                                 arch):
  # Gemma's layers come in local/global pairs.
  layers = 2 if arch == "gemma" else 1
  config = tiny_config(**dict(LLAMA, model__arch=arch),
                       model__num_decoder_layers=layers, train__num_steps=30,
                       train__log_every=1,
                       optimizer__warmup_steps=0,
                       checkpoint__every_steps=30)
  summary = loop.train(config, str(tmp_path))
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  assert len(losses) == 30 and np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
  # Held-out loss falls too, and greedy samples are judged by the gold reward.
  assert summary["eval/loss"] < summary["eval_before/loss"]
  assert np.isfinite(summary["eval/gold_reward"])
  assert 0.0 <= summary["eval/eos_rate"] <= 1.0
  assert 0 < summary["eval/length"] <= config.data.targets_length


# --- KTO --------------------------------------------------------------------

TRAJECTORY_SIGNATURE = {"prompt": TOKENS, "completion": TOKENS,
                        "reward": tf.TensorSpec([], tf.float32)}
# Prompts and completions of different lengths, including a prompt that
# fills its whole length and a completion that fills its whole length.
TRAJECTORIES = [([3, 10, 1], [11, 12, 1]),
                ([3, 4, 5, 6, 7, 1], [1]),
                ([3, 1], [8, 9, 10, 11]),
                ([3, 13, 14, 1], [15, 1])]


def _trajectory(prompt, completion):
  return {"prompt": np.array(prompt, np.int32),
          "completion": np.array(completion, np.int32),
          "reward": np.float32(0.0)}


@pytest.mark.parametrize("bos", [None, 2])
def test_mismatched_decoder_sequences_equal_the_converters(bos):
  lengths = {"prompt": 6, "completion": 4}
  converter = fc.DecoderTrajectoryFeatureConverter(prompt_bos_id=bos)
  rows = convert(converter, [_trajectory(*t) for t in TRAJECTORIES], lengths,
                 TRAJECTORY_SIGNATURE)
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  out = jax.jit(kto.with_mismatched_completions)(batch)
  # Independent construction: the converter on (prompt i, completion i+1).
  n = len(TRAJECTORIES)
  swapped = [_trajectory(TRAJECTORIES[i][0], TRAJECTORIES[(i + 1) % n][1])
             for i in range(n)]
  want = convert(converter, swapped, lengths, TRAJECTORY_SIGNATURE)
  for i in range(n):
    for suffix in fc.DECODER_SUFFIXES:
      np.testing.assert_array_equal(out[f"mismatched_{suffix}"][i],
                                    want[i][f"completion_{suffix}"],
                                    err_msg=f"row {i} {suffix}")
  # The real pairs and the prompts are untouched.
  for key, value in batch.items():
    np.testing.assert_array_equal(out[key], value, err_msg=key)


def test_kto_rejects_a_batch_without_completion_features():
  with pytest.raises(ValueError, match="neither decoder-only"):
    kto.with_mismatched_completions({"prompt_tokens": np.zeros((2, 3))})


def test_tiny_llama_kto_trains_with_finite_losses(tmp_path):
  examples = synthetic.make_examples("train", 32)
  path = str(tmp_path / "trajectory.jsonl")
  synthetic_feedback.write_synthetic_feedback(
      path, "trajectory", [e["inputs"] for e in examples],
      [[e["ideal"], e["targets"]] for e in examples], synthetic.gold_reward)
  config = tiny_config(**LLAMA, algorithm="kto", data__task="llama_kto",
                       optimizer__warmup_steps=0)
  config.data.files.train = path
  mesh = one_device_mesh()
  rules = sharding.as_rules(config.sharding.logical_axis_rules)

  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(kto.ALGORITHM), config, mesh)
    state = trainer.init_state()
    batch = next(trainer.train_batches(0))
    assert "completion_tokens" in batch and "prompt_tokens" in batch
    losses, baselines = [], []
    for _ in range(4):
      state, metrics = trainer.train_step(
          state, sharding.global_batch(batch, mesh, rules))
      losses.append(float(metrics["loss"]))
      baselines.append(float(metrics["kl_baseline"]))
  assert np.all(np.isfinite(losses)) and np.all(np.isfinite(baselines))
  assert losses[-1] < losses[0]
