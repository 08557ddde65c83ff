"""Tests of the GPT-NeoX / Pythia-style model.

Parity with Hugging Face's implementation is in test_hf_io.py; here are the
properties that must hold whatever the weights.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import gpt_neox
from jaxrlhf.models import hf_io
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import rotary

CONFIG = gpt_neox.GPTNeoXConfig.preset("tiny")
LENGTH = 8


@functools.lru_cache(maxsize=None)
def _jitted(config, method="apply"):
  return jax.jit(getattr(gpt_neox.GPTNeoX(config), method))


@pytest.fixture(scope="module")
def params():
  tokens = jnp.ones((1, 4), jnp.int32)
  variables = _jitted(CONFIG, "init")(jax.random.PRNGKey(0), tokens,
                                      jnp.zeros_like(tokens), tokens)
  # Noise on everything, so LayerNorm scales and biases are not the ones and
  # zeros of init and a dropped bias would show.
  rng = np.random.default_rng(0)
  return jax.tree.map(
      lambda x: x + 0.2 * rng.normal(size=x.shape).astype(np.float32),
      nn.meta.unbox(variables["params"]))


def _logits(config, params, tokens, mask):
  mask = jnp.asarray(mask, jnp.int32)
  return np.asarray(_jitted(config)(
      {"params": params}, jnp.asarray(tokens, jnp.int32),
      rotary.positions_from_mask(mask), mask))


def _batch(left):
  rng = np.random.default_rng(1)
  seqs = [rng.integers(2, CONFIG.vocab_size, size=n) for n in (8, 6, 2)]
  tokens = rng.integers(2, CONFIG.vocab_size, size=(3, LENGTH))  # pads: noise
  mask = np.zeros((3, LENGTH), np.int32)
  for i, s in enumerate(seqs):
    sl = slice(LENGTH - len(s), None) if left else slice(0, len(s))
    tokens[i, sl], mask[i, sl] = s, 1
  return tokens.astype(np.int32), mask, seqs


def test_left_and_right_padding_give_the_same_logits(params):
  left_tokens, left_mask, seqs = _batch(left=True)
  right_tokens, right_mask, _ = _batch(left=False)
  left = _logits(CONFIG, params, left_tokens, left_mask)
  right = _logits(CONFIG, params, right_tokens, right_mask)
  assert left.shape == (3, LENGTH, CONFIG.vocab_size)
  assert left.dtype == np.float32
  for i, s in enumerate(seqs):
    np.testing.assert_allclose(left[i, LENGTH - len(s):], right[i, :len(s)],
                               atol=2e-5, rtol=1e-5)


def test_scan_layers_matches_unrolled(params):
  tokens, mask, _ = _batch(left=True)
  expected = _logits(CONFIG, params, tokens, mask)
  scanned = gpt_neox.GPTNeoXConfig.preset("tiny", scan_layers=True,
                                          remat_policy="full")
  stacked = decoders.stack_layer_params(params, CONFIG.num_layers)
  np.testing.assert_allclose(_logits(scanned, stacked, tokens, mask),
                             expected, atol=1e-5, rtol=1e-5)


def test_parallel_residual_is_a_different_function(params):
  tokens, mask, _ = _batch(left=False)
  parallel = _logits(CONFIG, params, tokens, mask)
  sequential = _logits(
      gpt_neox.GPTNeoXConfig.preset("tiny", use_parallel_residual=False),
      params, tokens, mask)
  assert np.abs(parallel - sequential).max() > 1e-3


def test_bfloat16_compute_close_to_float32(params):
  tokens, mask, _ = _batch(left=True)
  f32 = _logits(CONFIG, params, tokens, mask)
  bf16 = _logits(gpt_neox.GPTNeoXConfig.preset("tiny", dtype="bfloat16"),
                 params, tokens, mask)
  real = mask.astype(bool)
  err = np.abs(bf16 - f32)[real]
  assert 0 < err.max() < 0.05 * np.abs(f32[real]).max(), err.max()


def test_dot_product_attention_matches_xla(params):
  tokens, mask, _ = _batch(left=True)
  config = gpt_neox.GPTNeoXConfig.preset("tiny", attention_impl="dot_product")
  np.testing.assert_allclose(_logits(config, params, tokens, mask),
                             _logits(CONFIG, params, tokens, mask),
                             atol=1e-5, rtol=1e-5)


def test_partial_rotary_leaves_the_other_channels_alone():
  assert CONFIG.head_dim == 16 and CONFIG.rotary_dim == 4
  x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 1, 2, 16)),
                  jnp.float32)
  inv_freq = rotary.rope_inverse_frequencies(CONFIG.rotary_dim, 10000.0)
  rotated = rotary.apply_rotary_embedding(x, jnp.array([[5]]), inv_freq)
  np.testing.assert_array_equal(rotated[..., 4:], x[..., 4:])
  assert np.abs(rotated[..., :4] - x[..., :4]).max() > 1e-2
  # Pair (0, 2) turns by 5 * inv_freq[0] = 5 radians: hand-computed rotation.
  c, s = np.cos(5.0), np.sin(5.0)
  np.testing.assert_allclose(rotated[..., 0], x[..., 0] * c - x[..., 2] * s,
                             atol=1e-5)
  np.testing.assert_allclose(rotated[..., 2], x[..., 2] * c + x[..., 0] * s,
                             atol=1e-5)


def test_parameters_carry_logical_names():
  tokens = jnp.ones((1, 3), jnp.int32)
  variables = jax.eval_shape(lambda: gpt_neox.GPTNeoX(CONFIG).init(
      jax.random.PRNGKey(0), tokens, jnp.zeros_like(tokens), tokens))
  names = {
      "/".join(str(getattr(k, "key", k)) for k in path): leaf.names
      for path, leaf in jax.tree_util.tree_leaves_with_path(
          variables["params"],
          is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))}
  layer = {
      "pre_self_attention_layer_norm/scale": ("embed",),
      "pre_self_attention_layer_norm/bias": ("embed",),
      "pre_mlp_layer_norm/scale": ("embed",),
      "pre_mlp_layer_norm/bias": ("embed",),
      "self_attention/query/kernel": ("embed", "heads", "kv"),
      "self_attention/query/bias": ("heads", "kv"),
      "self_attention/key/kernel": ("embed", "kv_heads", "kv"),
      "self_attention/key/bias": ("kv_heads", "kv"),
      "self_attention/value/kernel": ("embed", "kv_heads", "kv"),
      "self_attention/value/bias": ("kv_heads", "kv"),
      "self_attention/out/kernel": ("heads", "kv", "embed"),
      "self_attention/out/bias": ("embed",),
      "mlp/wi/kernel": ("embed", "mlp"),
      "mlp/wi/bias": ("mlp",),
      "mlp/wo/kernel": ("mlp", "embed"),
      "mlp/wo/bias": ("embed",),
  }
  expected = {"decoder/token_embedder/embedding": ("vocab", "embed"),
              "decoder/decoder_norm/scale": ("embed",),
              "decoder/decoder_norm/bias": ("embed",),
              "decoder/logits_dense/kernel": ("embed", "vocab")}
  for i in range(CONFIG.num_layers):
    expected.update({f"decoder/layers_{i}/{k}": v for k, v in layer.items()})
  assert names == expected


@pytest.mark.parametrize("preset, published", [
    # Total parameters of the EleutherAI/pythia-* checkpoints (Pythia README).
    ("pythia-70m", 70_426_624),
    ("pythia-1b", 1_011_781_632),
    ("pythia-6.9b", 6_857_302_016),
])
def test_presets_have_published_parameter_counts(preset, published):
  shapes = hf_io.expected_param_shapes(
      gpt_neox.GPTNeoXConfig.preset(preset, scan_layers=True))
  assert sum(math.prod(s) for s in shapes.values()) == published


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="emb_dim"):
    gpt_neox.GPTNeoXConfig.preset("tiny", num_heads=3)
  # An odd rotary dimension rotates one channel more (as transformers):
  # 15 channels of a 15-wide head would need 16.
  with pytest.raises(ValueError, match="rotates 16 channels"):
    gpt_neox.GPTNeoXConfig.preset("tiny", emb_dim=30, rotary_pct=1.0)
  with pytest.raises(ValueError, match="mlp_activation"):
    gpt_neox.GPTNeoXConfig.preset("tiny", mlp_activation="swish")
  with pytest.raises(ValueError, match="Unknown gpt_neox preset"):
    gpt_neox.GPTNeoXConfig.preset("pythia-3b")
