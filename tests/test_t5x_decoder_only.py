"""t5x decoder-only model against the outputs t5x itself computed.

The truth is `tests/fixtures/t5x/decoder_only/`: a checkpoint written by
t5x and the logits, scores and greedy decodes t5x's DecoderWrapper and
DecoderOnlyModel produced from it (see that folder's README.md).
"""

import functools
import itertools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import t5x_decoder_only as t5x_do
from jaxrlhf.models.t5x_checkpoint import read_t5x_checkpoint

# README: jit vs eager differs by 2.1e-6 on logits; an independent float32
# re-implementation should land within about 1e-5.
LOGITS_ATOL = 1e-5
SCORE_ATOL = 2e-5


@pytest.fixture(scope="module")
def fixture(t5x_fixtures):
  root = t5x_fixtures / "decoder_only"
  config = json.loads((root / "config.json").read_text())
  expected = dict(np.load(root / "expected.npz"))
  ckpt = read_t5x_checkpoint(root / "checkpoint_3")
  model_config = t5x_do.T5xDecoderOnlyConfig.from_t5x(
      config["TransformerConfig"])
  model = t5x_do.T5xDecoderOnly(model_config)
  # Compiled once per signature: eager Flax would dispatch op by op.
  apply = jax.jit(lambda params, *args, **kwargs: model.apply(
      {"params": params}, *args, method=model.t5x_logits, **kwargs))
  jit = functools.partial(jax.jit,
                          static_argnames="inputs_bidirectional_attention")
  return dict(config=config, expected=expected, params=ckpt["params"],
              step=ckpt["step"], model=model, apply=apply,
              model_config=model_config,
              token_scores=jit(functools.partial(t5x_do.token_scores, model)),
              score_batch=jit(functools.partial(t5x_do.score_batch, model)),
              greedy=jit(functools.partial(t5x_do.greedy_continuation, model)))


def _batch(expected):
  return {k: expected[k] for k in (
      "decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights",
      "decoder_causal_attention")}


def _flatten(tree, prefix=()):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flatten(value, prefix + (key,))
    else:
      yield "/".join(prefix + (key,)), value


def _abstract_init(model, length=4):
  """Parameter shapes, dtypes and logical axes without computing anything."""
  return jax.eval_shape(functools.partial(model.init,
                                          method=model.t5x_logits),
                        jax.random.PRNGKey(0), jnp.ones((1, length), jnp.int32))


# --- layout ------------------------------------------------------------------


def test_init_tree_is_t5x_layout(fixture):
  params = nn.meta.unbox(_abstract_init(fixture["model"])["params"])
  got = {name: (tuple(v.shape), str(v.dtype)) for name, v in _flatten(params)}
  want = {name: (tuple(info["shape"]), info["dtype"])
          for name, info in fixture["config"]["params"].items()}
  assert got == want
  assert fixture["step"] == 3


def test_logical_axes_map_to_t5x_mesh_specs(fixture):
  # t5x's standard_logical_axis_rules (1-D model parallelism), under which the
  # checkpoint's parameters were partitioned.
  rules = (("batch", "data"), ("vocab", "model"), ("embed", None),
           ("mlp", "model"), ("heads", "model"), ("kv", None),
           ("joined_kv", "model"), ("relpos_buckets", None),
           ("length", None), ("layers", None))
  specs = nn.get_partition_spec(_abstract_init(fixture["model"])["params"])
  got = {name: list(nn.logical_to_mesh_axes(spec, rules))
         for name, spec in _flatten(specs)}
  assert got == fixture["config"]["param_mesh_partition_specs"]


def test_untied_output_layer_is_logits_dense(fixture):
  cfg = t5x_do.T5xDecoderOnlyConfig(
      vocab_size=16, emb_dim=8, num_heads=2, num_layers=1, head_dim=4,
      mlp_dim=12, logits_via_embedding=False)
  model = t5x_do.T5xDecoderOnly(cfg)
  abstract = nn.meta.unbox(_abstract_init(model, 5)["params"])
  assert abstract["decoder"]["logits_dense"]["kernel"].shape == (8, 16)
  assert set(abstract["decoder"]["layers_0"]["mlp"]) == {"wi", "wo"}  # relu
  rng = np.random.default_rng(0)
  params = jax.tree.map(
      lambda a: rng.normal(size=a.shape).astype(np.float32), abstract)
  tokens = jnp.array([[0, 3, 4, 5, 6]], jnp.int32)
  hidden, logits = jax.jit(lambda p, t: (
      model.apply({"params": p}, t, t, method=model.t5x_hidden_states),
      model.apply({"params": p}, t, t, method=model.t5x_logits)))(params,
                                                                  tokens)
  np.testing.assert_allclose(
      logits, np.asarray(hidden) @ np.asarray(
          params["decoder"]["logits_dense"]["kernel"]), rtol=1e-5, atol=1e-5)
  assert logits.dtype == jnp.float32


# --- the attention mask ------------------------------------------------------


def test_mask_matches_t5x_docstring_example():
  # The packed prefix-LM example in t5x's make_decoder_mask docstring.
  targets = jnp.array([[6, 7, 8, 3, 4, 5, 0]])
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 0]])
  prefix = jnp.array([[1, 1, 0, 1, 1, 0, 0]])
  want = np.array([[1, 1, 0, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0, 0, 0],
                   [1, 1, 1, 0, 0, 0, 0],
                   [0, 0, 0, 1, 1, 0, 0],
                   [0, 0, 0, 1, 1, 0, 0],
                   [0, 0, 0, 1, 1, 1, 0],
                   [0, 0, 0, 0, 0, 0, 0]], bool)
  mask = t5x_do.make_decoder_mask(targets, prefix, segments)
  assert mask.shape == (1, 1, 7, 7)
  np.testing.assert_array_equal(mask[0, 0], want)


def test_mask_matches_elementwise_definition():
  rng = np.random.default_rng(0)
  batch, length = 3, 9
  targets = rng.integers(0, 4, (batch, length))
  prefix = rng.integers(0, 2, (batch, length))
  segments = rng.integers(1, 3, (batch, length))
  for with_prefix, with_segments in itertools.product((False, True), repeat=2):
    mask = np.asarray(t5x_do.make_decoder_mask(
        jnp.asarray(targets), jnp.asarray(prefix) if with_prefix else None,
        jnp.asarray(segments) if with_segments else None))
    for b, q, k in itertools.product(range(batch), range(length),
                                     range(length)):
      allowed = k <= q or (with_prefix and prefix[b, q] and prefix[b, k])
      allowed = allowed and targets[b, q] > 0 and targets[b, k] > 0
      if with_segments:
        allowed = allowed and segments[b, q] == segments[b, k]
      assert mask[b, 0, q, k] == allowed, (with_prefix, with_segments, b, q, k)


# --- forward pass and scores against t5x -------------------------------------


def test_logits_causal_match_t5x(fixture):
  e = fixture["expected"]
  logits = fixture["apply"](fixture["params"], e["decoder_input_tokens"],
                           e["decoder_target_tokens"])
  assert logits.shape == (3, 16, 128) and logits.dtype == jnp.float32
  # Padded positions included: the masking is reproduced exactly.
  np.testing.assert_allclose(logits, e["logits"], rtol=0, atol=LOGITS_ATOL)


def test_logits_prefix_bidirectional_match_t5x(fixture):
  e = fixture["expected"]
  logits = fixture["apply"](
      fixture["params"], e["decoder_input_tokens"], e["decoder_target_tokens"],
      decoder_causal_attention=e["decoder_causal_attention"])
  np.testing.assert_allclose(logits, e["logits_prefix_bidirectional"], rtol=0,
                             atol=LOGITS_ATOL)
  # The two fixtures really differ, so the mask option is exercised.
  assert np.abs(e["logits_prefix_bidirectional"] - e["logits"]).max() > 1e-2


def test_token_scores_and_score_batch_match_t5x(fixture):
  e = fixture["expected"]
  batch = _batch(e)
  scores = fixture["token_scores"](fixture["params"], batch)
  np.testing.assert_allclose(scores, e["token_scores"], rtol=0,
                             atol=SCORE_ATOL)
  assert np.all(np.asarray(scores)[e["decoder_loss_weights"] == 0] == 0)
  np.testing.assert_allclose(
      fixture["score_batch"](fixture["params"], batch),
      e["score_batch"], rtol=0, atol=SCORE_ATOL)
  # The README's printed values, an independent record of the same numbers.
  np.testing.assert_allclose(e["score_batch"],
                             [-12.542278, -11.057306, -19.164326], atol=1e-5)


def test_score_batch_prefix_bidirectional_matches_t5x(fixture):
  e = fixture["expected"]
  got = fixture["score_batch"](fixture["params"], _batch(e),
                           inputs_bidirectional_attention=True)
  np.testing.assert_allclose(got, e["score_batch_prefix_bidirectional"],
                             rtol=0, atol=SCORE_ATOL)
  np.testing.assert_allclose(got, [-12.636349, -11.332869, -19.117138],
                             atol=SCORE_ATOL)


def test_score_batch_by_hand_log_softmax(fixture):
  # Independent of token_scores: numpy log-softmax of the t5x logits.
  e = fixture["expected"]
  logits = e["logits"].astype(np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + \
      logits.max(-1)
  picked = np.take_along_axis(logits, e["decoder_target_tokens"][..., None],
                              -1)[..., 0]
  want = ((picked - logz) * e["decoder_loss_weights"]).sum(-1)
  np.testing.assert_allclose(
      fixture["score_batch"](fixture["params"], _batch(e)),
      want, rtol=0, atol=SCORE_ATOL)


def test_prefix_scoring_requires_causal_attention_feature(fixture):
  batch = _batch(fixture["expected"])
  del batch["decoder_causal_attention"]
  with pytest.raises(ValueError, match="decoder_causal_attention"):
    fixture["score_batch"](fixture["params"], batch,
                       inputs_bidirectional_attention=True)


# --- masking properties ------------------------------------------------------


def test_causal_and_prefix_visibility(fixture):
  e = fixture["expected"]
  apply, params = fixture["apply"], fixture["params"]
  row = e["decoder_input_tokens"][:1]  # prompt occupies positions 0..4
  prefix = e["decoder_causal_attention"][:1]
  changed = row.copy()
  changed[0, 3] = 99  # a prompt token
  for kwargs, earlier_changes in (({}, False),
                                  ({"decoder_causal_attention": prefix}, True)):
    a = apply(params, row, **kwargs)
    b = apply(params, changed, **kwargs)
    # Positions before 3 see position 3 only through the bidirectional prefix.
    assert (np.abs(a[0, :3] - b[0, :3]).max() > 1e-3) == earlier_changes
    assert np.abs(a[0, 3:] - b[0, 3:]).max() > 1e-3
    # Nothing sees a later change outside the prefix region.
    later = row.copy()
    later[0, 9] = 99
    c = apply(params, later, **kwargs)
    np.testing.assert_array_equal(a[0, :9], c[0, :9])


# --- greedy decoding against t5x predict_batch -------------------------------


@pytest.mark.parametrize("bidirectional,key", [
    (False, "predict_greedy"),
    (True, "predict_greedy_prefix_bidirectional")])
def test_greedy_matches_t5x_predict(fixture, bidirectional, key):
  e = fixture["expected"]
  decode = functools.partial(
      fixture["greedy"], inputs_bidirectional_attention=bidirectional)
  # t5x uses only decoder_input_tokens * decoder_causal_attention: passing the
  # prompt-only inputs must give the same result as the full eval batch.
  for inputs in (e["decoder_input_tokens"], e["predict_prompt_inputs"]):
    tokens, finished = decode(fixture["params"], inputs,
                              e["decoder_causal_attention"])
    np.testing.assert_array_equal(tokens, e[key])
    assert tokens.dtype == jnp.int32
    np.testing.assert_array_equal(finished, (e[key] == 1).any(axis=1))


def test_greedy_rows_from_readme(fixture):
  # The README spells the decodes out; row 1 of the prefix-LM decode uses its
  # whole budget of 16 - 8 tokens without an EOS.
  e = fixture["expected"]
  tokens, finished = fixture["greedy"](
      fixture["params"], e["decoder_input_tokens"],
      e["decoder_causal_attention"], inputs_bidirectional_attention=True)
  np.testing.assert_array_equal(tokens[1], [5, 6, 8, 8, 8, 8, 8, 8] + [0] * 8)
  np.testing.assert_array_equal(finished, [True, False, True])
  # Row 2's prompt is [35, EOS]: the prompt's own EOS does not stop decoding.
  np.testing.assert_array_equal(tokens[2], [36, 37, 38, 39, 40, 1] + [0] * 10)


# --- options and errors ------------------------------------------------------


def test_remat_and_bfloat16_variants_run(fixture):
  e = fixture["expected"]
  cfg = fixture["model_config"]
  remat = t5x_do.T5xDecoderOnly(
      t5x_do.T5xDecoderOnlyConfig(**{**cfg.__dict__, "remat_policy": "full"}))
  logits = jax.jit(functools.partial(remat.apply, method=remat.t5x_logits))(
      {"params": fixture["params"]},
                                e["decoder_input_tokens"],
                                e["decoder_target_tokens"])
  np.testing.assert_allclose(logits, e["logits"], rtol=0, atol=LOGITS_ATOL)
  bf16 = t5x_do.T5xDecoderOnly(
      t5x_do.T5xDecoderOnlyConfig(**{**cfg.__dict__, "dtype": "bfloat16"}))
  logits = jax.jit(functools.partial(bf16.apply, method=bf16.t5x_logits))(
      {"params": fixture["params"]},
                               e["decoder_input_tokens"],
                               e["decoder_target_tokens"])
  assert logits.dtype == jnp.float32
  weights = e["decoder_loss_weights"] > 0
  # Same next-token choice where it matters (target positions).
  agree = (np.argmax(logits, -1) == np.argmax(e["logits"], -1))[weights]
  assert agree.mean() > 0.9


def test_bad_inputs_are_named():
  with pytest.raises(ValueError, match="from_t5x: unknown fields"):
    t5x_do.T5xDecoderOnlyConfig.from_t5x({"vocab_size": 8, "emb_dims": 4})
  with pytest.raises(ValueError, match="num_heads"):
    t5x_do.T5xDecoderOnlyConfig(num_heads=0)
  with pytest.raises(ValueError, match="mlp_activations"):
    t5x_do.T5xDecoderOnlyConfig(mlp_activations="gelu")
  model = t5x_do.T5xDecoderOnly(t5x_do.T5xDecoderOnlyConfig(
      vocab_size=8, emb_dim=4, num_heads=1, num_layers=1, head_dim=4,
      mlp_dim=4))
  init = functools.partial(model.init, method=model.t5x_logits)
  with pytest.raises(ValueError, match=r"decoder_target_tokens has shape"):
    init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32),
         jnp.ones((1, 5), jnp.int32))
  with pytest.raises(ValueError, match=r"\[batch, length\]"):
    init(jax.random.PRNGKey(0), jnp.ones((4,), jnp.int32))
  with pytest.raises(ValueError, match="integer token ids"):
    init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.float32))
