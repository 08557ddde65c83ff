"""Packing several examples per row (config.data.pack): the packer's layout,
and a train step on a packed batch giving the loss, every metric and the
update of the same step on the unpacked batch of the same examples.

The truth used: a packed row only moves examples next to each other, with
attention confined to each example (segment ids) and positions restarting,
so every per-example quantity (a completion's log-prob, its length, V(x),
a token's cross-entropy) is the unpacked one, and a loss that is a mean
over examples (or target tokens) weighted by the example mask is the
unpacked loss.
"""

import flax.linen as nn
import jax
import numpy as np
import pytest
import tensorflow as tf

from conftest import from_scratch, one_device_mesh, synthetic_feedback_file
from conftest import tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf.data import feature_converters
from jaxrlhf.data import pipeline


def _packed(batch, k, rows_multiple=1):
  """`batch` (one example per row) packed k per row, with empty rows added
  up to a multiple of `rows_multiple`."""
  spec = {name: tf.TensorSpec(value.shape[1:], tf.as_dtype(value.dtype))
          for name, value in batch.items()}
  packed = feature_converters.Packer(spec, k).pack(batch)
  rows = len(packed[feature_converters.EXAMPLE_MASK])
  extra = -rows % rows_multiple
  packed = {n: np.concatenate([v, np.zeros((extra,) + v.shape[1:], v.dtype)])
            for n, v in packed.items()}
  assert len(packed[feature_converters.EXAMPLE_MASK]) < len(
      next(iter(batch.values())))
  return packed


def test_packer_lays_examples_end_to_end_and_keeps_their_slots():
  # Two decoder-only pair examples and one whose chosen row is too long to
  # share: chosen (3 + 2) and rejected (3 + 4) tokens of example 0, (1 + 1)
  # and (1 + 1) of example 1, (3 + 5) and (3 + 1) of example 2, rows of 9.
  def example(prompt, chosen, rejected, margin):
    out = {"margin": np.float32(margin)}
    for field, completion in (("chosen", chosen), ("rejected", rejected)):
      tokens = np.zeros(9, np.int32)
      tokens[:prompt + completion] = np.arange(1, prompt + completion + 1)
      weights = np.zeros(9, np.int32)
      weights[prompt:prompt + completion] = 1
      out.update({f"{field}_tokens": tokens, f"{field}_loss_weights": weights,
                  f"{field}_positions": np.where(tokens > 0,
                                                 np.arange(9), 0),
                  f"{field}_attention_mask": (tokens > 0).astype(np.int32)})
    out["prompt_tokens"] = np.ones(3, np.int32)  # dropped when packing
    return out

  examples = [example(3, 2, 4, 0.5), example(1, 1, 1, 1.5),
              example(3, 5, 1, 2.5)]
  batch = {n: np.stack([e[n] for e in examples]) for n in examples[0]}
  spec = {n: tf.TensorSpec(v.shape[1:], tf.as_dtype(v.dtype))
          for n, v in batch.items()}
  packer = feature_converters.Packer(spec, 2)
  packed = packer.pack(batch)
  assert "prompt_tokens" not in packed
  assert set(packed) == set(packer.output_spec())
  # First-fit: example 1 joins example 0's row; example 2 fits in neither
  # (chosen 5 + 2 + 8 > 9) and opens a second row.
  np.testing.assert_array_equal(packed["example_mask"], [[1, 1], [1, 0]])
  np.testing.assert_array_equal(packed["margin"], [[0.5, 1.5], [2.5, 0]])
  np.testing.assert_array_equal(packed["chosen_segment_ids"][0],
                                [1] * 5 + [2] * 2 + [0] * 2)
  np.testing.assert_array_equal(packed["rejected_segment_ids"][0],
                                [1] * 7 + [2] * 2)
  np.testing.assert_array_equal(packed["chosen_positions"][0],
                                [0, 1, 2, 3, 4, 0, 1, 0, 0])
  np.testing.assert_array_equal(packed["rejected_loss_weights"][0],
                                [0, 0, 0, 1, 1, 1, 1, 0, 1])
  np.testing.assert_array_equal(packed["chosen_tokens"][1][:8],
                                np.arange(1, 9))
  assert feature_converters.padding_share(packed) < (
      feature_converters.padding_share(batch))


def test_pipeline_packs_every_example_once():
  lengths = {"inputs": 16, "targets": 16}
  converter = feature_converters.sft_feature_converter("encoder_decoder")
  unpacked = pipeline.BatchIterator(
      "synthetic_summarize", "validation", lengths, converter, 8, seed=0,
      shuffle=False, num_epochs=1, drop_remainder=False)
  packed = pipeline.BatchIterator(
      "synthetic_summarize", "validation", lengths, converter, 8, seed=0,
      shuffle=False, num_epochs=1, drop_remainder=False, pack=3)

  def targets(batches, key="decoder_segment_ids"):
    out = []
    for b in batches:
      for r in range(len(b["decoder_target_tokens"])):
        ids = b[key][r] if key in b else (
            b["decoder_target_tokens"][r] > 0).astype(int)
        for s in range(1, ids.max() + 1):
          out.append(tuple(b["decoder_target_tokens"][r][ids == s]))
    return sorted(out)

  packed = list(packed)
  assert targets(packed) == targets(unpacked)
  # The train step is compiled for what the trainer plans
  # (`Offline.batch_spec`): the packer's spec of the converter's.
  spec = feature_converters.Packer(feature_converters.output_spec(
      converter, None, lengths), 3).output_spec()
  assert {n: (v.shape[1:], v.dtype) for n, v in packed[0].items()} == {
      n: (tuple(s.shape), s.dtype.as_numpy_dtype) for n, s in spec.items()}


# name -> (algorithm, arch, micro-batches, config overrides): SFT's mean
# over target tokens, DPO's chosen and rejected rows in one concatenated
# pass and micro-batches holding different numbers of examples, DRO-V's
# value of each packed prompt (decoder-only: read in the completion rows)
# and its single-network value from the policy's logits.
CASES = {
    "sft_llama": ("sft", "llama", 2, {}),
    "dpo_t5": ("dpo", "t5", 2, {}),
    "dro_v_llama": ("dro_v", "llama", 1, {}),
    "dro_v_t5_logits": ("dro_v", "t5", 1,
                        {"dro__value_source": "policy_logits"}),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  directory = tmp_path_factory.mktemp("packing")
  return {kind: synthetic_feedback_file(directory, kind, count=16)
          for kind in ("pairs", "trajectory")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_step_equals_the_unpacked_step(case, files):
  name, arch, micro, overrides = CASES[case]
  # SGD: the update is the gradient itself (Adafactor divides each row of
  # a matrix by its own scale, which turns float rounding in a near-zero
  # gradient row, e.g. of a rare token's embedding, into a full step).
  settings = dict(algorithm=name, train__batch_size=8,
                  train__num_microbatches=micro, optimizer__name="sgd",
                  optimizer__warmup_steps=0, **overrides)
  if arch != "t5":
    settings.update(model__arch=arch, model__size="tiny",
                    model__num_encoder_layers=None)
  if name == "sft":
    settings["data__task"] = "synthetic_summarize"
  else:
    settings["data__task"] = f"packing_{case}"
  config = tiny_config(**settings)
  algorithm = algorithms.get(name)
  if name != "sft":
    config.data.files.train = files[algorithm.data]
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithm), config, mesh)
    state = jax.device_get(trainer.init_state())
    if "reference" in state.frozen:
      # A reference unlike the policy, so that log-ratios are not 0.
      state = state.replace(frozen={"reference": jax.tree.map(
          lambda x: x * 0.9, state.params["policy"])})
    unpacked = next(trainer.train_batches(0))
    packed = _packed(unpacked, 4, rows_multiple=micro)

    def step(batch):
      on_device = jax.device_put(state, trainer.state_shardings)
      after, metrics = trainer.train_step(
          on_device, sharding.global_batch(batch, mesh, rules))
      return jax.device_get(after.params), jax.device_get(metrics)

    params_u, metrics_u = step(unpacked)
    params_p, metrics_p = step(packed)
  assert metrics_u["nonfinite"] == 0
  assert set(metrics_p) == set(metrics_u)
  for key in metrics_u:
    np.testing.assert_allclose(metrics_p[key], metrics_u[key], rtol=2e-5,
                               atol=2e-6, err_msg=key)
  jax.tree.map(lambda p, u: np.testing.assert_allclose(p, u, rtol=1e-5,
                                                       atol=1e-6),
               params_p, params_u)


def test_packing_config_is_checked():
  config = tiny_config(algorithm="kto", data__pack=4)
  with pytest.raises(ValueError, match="config.data.pack: 'kto' does not"):
    defaults.validate(config)
  config = tiny_config(algorithm="dpo", data__pack=4,
                       reference_logprobs__mode="precomputed")
  with pytest.raises(ValueError, match="config.data.pack: packed rows need"):
    defaults.validate(config)
  defaults.validate(tiny_config(algorithm="dro_v", data__pack=4))
