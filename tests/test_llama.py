"""Tests of the Llama-style model and the shared decoder-only layers.

Parity with Hugging Face's implementation is in test_hf_io.py; here are the
properties that must hold whatever the weights: padding invariance, causality,
scan/unrolled equivalence, attention implementations agreeing, rotary
relative-position invariance, logical names, published parameter counts.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import hf_io
from jaxrlhf.models import llama
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import rotary

CONFIG = llama.LlamaConfig.preset("tiny")


# Whole-model jit compiles far faster than op-by-op dispatch of each new
# shape, which keeps these tests quick.
@functools.lru_cache(maxsize=None)
def _jitted(config, method="apply"):
  return jax.jit(getattr(llama.Llama(config), method))


def _init(config):
  tokens = jnp.ones((1, 4), jnp.int32)
  return _jitted(config, "init")(jax.random.PRNGKey(0), tokens,
                                 jnp.zeros_like(tokens), tokens)


@pytest.fixture(scope="module")
def params():
  return nn.meta.unbox(_init(CONFIG)["params"])


def _logits(config, params, tokens, mask):
  mask = jnp.asarray(mask, jnp.int32)
  return np.asarray(_jitted(config)(
      {"params": params}, jnp.asarray(tokens, jnp.int32),
      rotary.positions_from_mask(mask), mask))


LENGTH = 8


def _sequences():
  rng = np.random.default_rng(0)
  return [rng.integers(2, CONFIG.vocab_size, size=n) for n in (8, 5, 1)]


def _pad(seqs, length, left, pad_rng=None):
  """Pads with 0, or with random tokens (the mask alone must hide them)."""
  tokens = np.zeros((len(seqs), length), np.int32)
  if pad_rng is not None:
    tokens = pad_rng.integers(2, CONFIG.vocab_size, size=tokens.shape)
  mask = np.zeros((len(seqs), length), np.int32)
  for i, s in enumerate(seqs):
    sl = slice(length - len(s), length) if left else slice(0, len(s))
    tokens[i, sl], mask[i, sl] = s, 1
  return tokens.astype(np.int32), mask


def test_left_and_right_padding_give_the_same_logits(params):
  seqs = _sequences()
  rng = np.random.default_rng(3)
  right_tokens, right_mask = _pad(seqs, LENGTH, left=False, pad_rng=rng)
  left_tokens, left_mask = _pad(seqs, LENGTH, left=True, pad_rng=rng)
  right = _logits(CONFIG, params, right_tokens, right_mask)
  left = _logits(CONFIG, params, left_tokens, left_mask)
  assert right.dtype == np.float32
  assert right.shape == (3, LENGTH, CONFIG.vocab_size)
  for i, s in enumerate(seqs):
    np.testing.assert_allclose(left[i, LENGTH - len(s):], right[i, :len(s)],
                               atol=2e-5, rtol=1e-5)
  # Row 0 is unpadded in both layouts; the others differ from it.
  assert np.abs(left[1, -1] - left[0, -1]).max() > 1e-3
  assert np.all(np.isfinite(left)) and np.all(np.isfinite(right))


def test_causal_future_tokens_do_not_change_past_logits(params):
  tokens, mask = _pad(_sequences(), LENGTH, left=False)
  changed = tokens.copy()
  changed[0, 4:] = (tokens[0, 4:] + 1) % CONFIG.vocab_size
  a, b = _logits(CONFIG, params, tokens, mask), _logits(CONFIG, params,
                                                         changed, mask)
  np.testing.assert_array_equal(a[0, :4], b[0, :4])
  assert np.abs(a[0, 4:] - b[0, 4:]).max() > 1e-3
  np.testing.assert_array_equal(a[1:], b[1:])  # rows do not mix


def test_scan_layers_matches_unrolled(params):
  tokens, mask = _pad(_sequences(), LENGTH, left=True)
  expected = _logits(CONFIG, params, tokens, mask)
  stacked = decoders.stack_layer_params(params, CONFIG.num_layers)
  assert stacked["decoder"]["layers"]["mlp"]["wo"]["kernel"].shape == (
      CONFIG.num_layers, CONFIG.mlp_dim, CONFIG.emb_dim)
  # (GPT-NeoX's test runs the scan under remat_policy='full'.)
  scanned = llama.LlamaConfig.preset("tiny", scan_layers=True)
  np.testing.assert_allclose(_logits(scanned, stacked, tokens, mask),
                             expected, atol=1e-5, rtol=1e-5)
  restored = decoders.unstack_layer_params(stacked)
  jax.tree.map(np.testing.assert_array_equal, restored, params)


def test_remat_does_not_change_gradients(params):
  tokens, mask = _pad(_sequences(), LENGTH, left=False)
  # One layer keeps the two backward compilations cheap.
  one_layer = {"decoder": {k: v for k, v in params["decoder"].items()
                           if k != "layers_1"}}

  def loss(p, remat):
    config = llama.LlamaConfig.preset("tiny", num_layers=1,
                                      remat_policy=remat)
    logits = llama.Llama(config).apply(
        {"params": p}, jnp.asarray(tokens), rotary.positions_from_mask(mask),
        jnp.asarray(mask))
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * mask)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  plain, remat = grad(one_layer, "none"), grad(one_layer, "dots_saveable")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               plain, remat)
  assert np.abs(plain["decoder"]["layers_0"]["mlp"]["wo"]["kernel"]).max() > 0


def test_bfloat16_compute_close_to_float32(params):
  tokens, mask = _pad(_sequences(), LENGTH, left=True)
  f32 = _logits(CONFIG, params, tokens, mask)
  bf16_config = llama.LlamaConfig.preset("tiny", dtype="bfloat16")
  bf16 = _logits(bf16_config, params, tokens, mask)
  assert bf16.dtype == np.float32
  real = mask.astype(bool)
  err = np.abs(bf16 - f32)[real]
  # bfloat16 has 8 mantissa bits (relative rounding 2^-9 ~ 0.2%); a few
  # roundings per layer keep the error at a few percent of the logit scale.
  assert err.max() < 0.05 * np.abs(f32[real]).max(), err.max()
  assert err.max() > 0  # the compute really ran in bfloat16
  # Parameters stay float32 when initialised for a bfloat16 model.
  variables = _abstract_init(bf16_config)
  assert {x.dtype for x in jax.tree.leaves(nn.meta.unbox(variables))} == {
      jnp.dtype(jnp.float32)}


def test_dot_product_attention_matches_xla(params):
  tokens, mask = _pad(_sequences(), LENGTH, left=True)
  xla = _logits(CONFIG, params, tokens, mask)
  config = llama.LlamaConfig.preset("tiny", attention_impl="dot_product")
  np.testing.assert_allclose(_logits(config, params, tokens, mask), xla,
                             atol=1e-5, rtol=1e-5)


def test_attend_matches_loop_reference():
  """Grouped-query attention against a per-head numpy loop."""
  rng = np.random.default_rng(1)
  batch, length, heads, kv_heads, dim = 2, 5, 6, 2, 4
  q = rng.normal(size=(batch, length, heads, dim)).astype(np.float32)
  k = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
  v = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
  attention_mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
  mask = attentions.causal_padding_mask(attention_mask)
  expected = np.zeros_like(q)
  for b in range(batch):
    for h in range(heads):
      g = h // (heads // kv_heads)
      for t in range(length):
        keys = [s for s in range(t + 1) if attention_mask[b, s]] or [t]
        scores = np.array([q[b, t, h] @ k[b, s, g] for s in keys]) / 2.0
        w = np.exp(scores - scores.max())
        w /= w.sum()
        expected[b, t, h] = sum(wi * v[b, s, g] for wi, s in zip(w, keys))
  for impl in ("xla", "dot_product"):
    out = attentions.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                            mask, impl=impl)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


def test_rotary_scores_depend_only_on_relative_position():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  scaling = rotary.RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
  inv_freq = rotary.rope_inverse_frequencies(8, 500000.0, scaling)

  def score(m, n):
    qm = rotary.apply_rotary_embedding(q, jnp.array([[m]]), inv_freq)
    kn = rotary.apply_rotary_embedding(k, jnp.array([[n]]), inv_freq)
    return float(jnp.sum(qm * kn))

  assert score(3, 1) == pytest.approx(score(12, 10), abs=1e-4)
  assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), abs=1e-5)
  assert abs(score(5, 0) - score(0, 0)) > 1e-3
  # Rotation preserves norms.
  rotated = rotary.apply_rotary_embedding(q, jnp.array([[7]]), inv_freq)
  assert float(jnp.linalg.norm(rotated)) == pytest.approx(
      float(jnp.linalg.norm(q)), rel=1e-5)


def test_llama3_rope_scaling_bands():
  """Hand-computed: wavelengths beyond original/low_freq_factor are divided
  by `factor`, below original/high_freq_factor kept, in between blended."""
  theta, dim = 10000.0, 8
  base = 1.0 / theta ** (np.arange(0, dim, 2) / dim)  # wavelengths 2pi/base
  scaled = rotary.rope_inverse_frequencies(
      dim, theta, rotary.RopeScaling("llama3", 4.0, 1.0, 4.0, 64))
  # wavelengths: 6.28 (< 16: kept), 62.8 (16..64: blended), 628 and 6283
  # (> 64: divided by 4).
  np.testing.assert_allclose(scaled[0], base[0], rtol=1e-6)
  np.testing.assert_allclose(scaled[2:], base[2:] / 4.0, rtol=1e-6)
  smooth = (64 / (2 * np.pi / base[1]) - 1.0) / (4.0 - 1.0)
  np.testing.assert_allclose(
      scaled[1], (1 - smooth) * base[1] / 4.0 + smooth * base[1], rtol=1e-5)


def _abstract_init(config):
  """Boxed variables with shapes only (eval_shape: nothing is computed)."""
  tokens = jnp.ones((1, 3), jnp.int32)
  return jax.eval_shape(lambda: llama.Llama(config).init(
      jax.random.PRNGKey(0), tokens, jnp.zeros_like(tokens), tokens))


def test_parameters_carry_logical_names():
  config = llama.LlamaConfig.preset("tiny", tie_embeddings=True)
  variables = _abstract_init(config)
  names = {
      "/".join(str(getattr(k, "key", k)) for k in path): leaf.names
      for path, leaf in jax.tree_util.tree_leaves_with_path(
          variables["params"],
          is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))}
  layer = {
      "pre_self_attention_layer_norm/scale": ("embed",),
      "self_attention/query/kernel": ("embed", "heads", "kv"),
      "self_attention/key/kernel": ("embed", "kv_heads", "kv"),
      "self_attention/value/kernel": ("embed", "kv_heads", "kv"),
      "self_attention/out/kernel": ("heads", "kv", "embed"),
      "pre_mlp_layer_norm/scale": ("embed",),
      "mlp/wi_0/kernel": ("embed", "mlp"),
      "mlp/wi_1/kernel": ("embed", "mlp"),
      "mlp/wo/kernel": ("mlp", "embed"),
  }
  expected = {"decoder/token_embedder/embedding": ("vocab", "embed"),
              "decoder/decoder_norm/scale": ("embed",)}
  for i in range(config.num_layers):
    expected.update({f"decoder/layers_{i}/{k}": v for k, v in layer.items()})
  assert names == expected  # tied: no logits_dense

  scanned = llama.LlamaConfig.preset("tiny", scan_layers=True)
  variables = _abstract_init(scanned)
  stacked = variables["params"]["decoder"]["layers"]
  assert stacked["self_attention"]["key"]["kernel"].names == (
      "layers", "embed", "kv_heads", "kv")
  assert variables["params"]["decoder"]["logits_dense"]["kernel"].names == (
      "embed", "vocab")


@pytest.mark.parametrize("preset, published", [
    # Parameter totals reported for the released checkpoints.
    ("llama2-7b", 6_738_415_616),
    ("llama3.2-1b", 1_235_814_400),  # tied, grouped-query
    ("tinyllama-1.1b", 1_100_048_384),
])
def test_presets_have_published_parameter_counts(preset, published):
  # Scanned, so that only one layer is traced.
  shapes = hf_io.expected_param_shapes(
      llama.LlamaConfig.preset(preset, scan_layers=True))
  assert sum(math.prod(s) for s in shapes.values()) == published


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="num_kv_heads"):
    llama.LlamaConfig.preset("tiny", num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="attention_impl"):
    llama.LlamaConfig.preset("tiny", attention_impl="flash")
  with pytest.raises(ValueError, match="remat_policy"):
    llama.LlamaConfig.preset("tiny", remat_policy="some")
  with pytest.raises(ValueError, match="Unknown llama preset"):
    llama.LlamaConfig.preset("llama-9b")


def test_mismatched_input_shapes_are_rejected(params):
  with pytest.raises(ValueError, match="one shape"):
    _jitted(CONFIG)({"params": params}, jnp.ones((2, 4), jnp.int32),
                              jnp.zeros((2, 3), jnp.int32),
                              jnp.ones((2, 4), jnp.int32))


def test_traces_under_a_mesh_with_logical_axis_rules():
  """Parameter and activation names must fit their arrays' ranks once rules
  turn them into sharding constraints (t5x-style rules, 1-device mesh)."""
  rules = (("batch", "data"), ("vocab", "model"), ("mlp", "model"),
           ("heads", "model"), ("kv_heads", None), ("kv", None),
           ("embed", None), ("length", None), ("layers", None))
  mesh = jax.make_mesh((1, 1), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  tokens = jnp.ones((2, 4), jnp.int32)
  for config in (CONFIG, llama.LlamaConfig.preset("tiny", scan_layers=True)):
    model = llama.Llama(config)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      variables = jax.eval_shape(lambda m=model: m.init(
          jax.random.PRNGKey(0), tokens, tokens, tokens))
      specs = nn.get_partition_spec(variables)
      logits = jax.eval_shape(lambda v, m=model: m.apply(
          nn.meta.unbox(v), tokens, tokens, tokens), variables)
    assert logits.shape == (2, 4, config.vocab_size)
    query = specs["params"]["decoder"]
    query = query["layers"] if config.scan_layers else query["layers_0"]
    expected = (("layers",) if config.scan_layers else ()) + (
        "embed", "heads", "kv")
    assert query["self_attention"]["query"]["kernel"] == (
        jax.sharding.PartitionSpec(*expected))


def test_hidden_states_feed_the_output_layer(params):
  """`hidden_states` (for value and reward heads) times the output kernel
  gives the logits."""
  tokens, mask = _pad(_sequences(), LENGTH, left=True)
  hidden = jax.jit(functools.partial(
      llama.Llama(CONFIG).apply, method=llama.Llama.hidden_states))(
          {"params": params}, jnp.asarray(tokens),
          rotary.positions_from_mask(mask), jnp.asarray(mask))
  assert hidden.shape == (3, LENGTH, CONFIG.emb_dim)
  kernel = params["decoder"]["logits_dense"]["kernel"]
  np.testing.assert_allclose(np.asarray(hidden) @ np.asarray(kernel),
                             _logits(CONFIG, params, tokens, mask),
                             atol=1e-5, rtol=1e-5)
