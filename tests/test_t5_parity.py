"""Our T5 reproduces t5x's own outputs from a checkpoint t5x wrote."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import sampling
from jaxrlhf.models import scoring
from jaxrlhf.models import t5
from jaxrlhf.models.layers import t5_attention
from jaxrlhf.models.t5x_checkpoint import read_t5x_checkpoint


def _model_for(fixture_dir):
  cfg = json.load(open(fixture_dir / "config.json"))["T5Config"]
  config = t5.T5Config(**{k: (tuple(v) if isinstance(v, list) else v)
                          for k, v in cfg.items()})
  return t5.T5(config)


@pytest.fixture(scope="module")
def encdec(t5x_fixtures):
  root = t5x_fixtures / "encdec"
  params = read_t5x_checkpoint(root / "checkpoint_3")["params"]
  return _model_for(root), params, dict(np.load(root / "expected.npz"))


def test_logits_encoder_output_and_scores_match_t5x(encdec):
  model, params, e = encdec
  logits = jax.jit(model.apply)({"params": params}, e["encoder_input_tokens"],
                                e["decoder_input_tokens"],
                                e["decoder_target_tokens"])
  # Same masking as t5x, so even padded positions agree.
  np.testing.assert_allclose(logits, e["logits"], atol=1e-4, rtol=0)
  encoded = model.apply({"params": params}, e["encoder_input_tokens"],
                        method=model.encode)
  np.testing.assert_allclose(encoded, e["encoder_output"], atol=1e-4, rtol=0)
  scores = scoring.token_logprobs(logits, e["decoder_target_tokens"])
  scores = scores * e["decoder_loss_weights"]
  np.testing.assert_allclose(scores, e["token_scores"], atol=1e-4, rtol=0)
  np.testing.assert_allclose(scores.sum(-1), e["score_batch"], atol=1e-4,
                             rtol=1e-6)


def test_greedy_decode_matches_t5x_predict_batch(encdec):
  model, params, e = encdec
  out = sampling.sample_encoder_decoder(
      model, params, jnp.asarray(e["encoder_input_tokens"]),
      jax.random.PRNGKey(0), e["predict_greedy"].shape[1], greedy=True)
  np.testing.assert_array_equal(out.tokens, e["predict_greedy"])
  # Row 2 of the fixture never emits EOS.
  np.testing.assert_array_equal(out.has_eos, [True, True, False])
  np.testing.assert_array_equal(out.mask, e["predict_greedy"] > 0)


@pytest.mark.parametrize("variant,atol", [("encdec_gzip", 1e-4),
                                          ("encdec_bf16", 0.05)])
def test_checkpoint_variants_give_the_same_model(t5x_fixtures, encdec, variant,
                                                 atol):
  model, _, e = encdec
  params = read_t5x_checkpoint(t5x_fixtures / variant / "checkpoint_3",
                               restore_dtype=np.float32)["params"]
  logits = model.apply({"params": params}, e["encoder_input_tokens"],
                       e["decoder_input_tokens"], e["decoder_target_tokens"])
  # The README bounds bf16-rounded parameters' logit drift by 0.025.
  np.testing.assert_allclose(logits, e["logits"], atol=atol, rtol=0)


def test_bfloat16_compute_stays_close_to_float32(encdec):
  model, params, e = encdec
  bf16 = t5.T5(t5.T5Config(**{**model.config.__dict__, "dtype": "bfloat16"}))
  logits = bf16.apply({"params": params}, e["encoder_input_tokens"],
                      e["decoder_input_tokens"], e["decoder_target_tokens"])
  assert logits.dtype == jnp.bfloat16
  w = e["decoder_loss_weights"][..., None] > 0
  err = np.abs(np.asarray(logits, np.float32) - e["logits"]) * w
  scale = np.abs(e["logits"]).max()
  assert err.max() < 0.05 * scale


def test_relative_position_buckets_by_hand():
  # Bidirectional, 32 buckets: offsets 0..7 exact; negative offsets (memory
  # before query) in the upper half; far offsets share log-spaced buckets.
  b = t5_attention.relative_position_bucket(
      np.array([0, 1, -1, 7, -7, 8, 127, 1000]), True, 32, 128)
  assert list(b[:5]) == [0, 16 + 1, 1, 16 + 7, 7]
  # n = 8: 8 + floor(log(8/8) / log(128/8) * 8) = 8; n = 127: 8 + floor(7.98).
  assert list(b[5:]) == [16 + 8, 16 + 15, 16 + 15]
  # Unidirectional: future positions (memory after query) all map to 0.
  u = t5_attention.relative_position_bucket(
      np.array([3, 0, -3, -20, -200]), False, 32, 128)
  # n = 20: 16 + floor(log(20/16) / log(128/16) * 16) = 16 + floor(1.72).
  assert list(u) == [0, 0, 3, 17, 31]
