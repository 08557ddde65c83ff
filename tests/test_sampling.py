"""The sampler draws from the softmax of the filtered logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import sampling
from jaxrlhf.models import t5


def test_filter_logits_by_hand():
  logits = jnp.log(jnp.array([0.5, 0.2, 0.15, 0.1, 0.05]))
  keep = lambda x: np.asarray(x > -1e29)
  assert keep(sampling.filter_logits(logits, top_k=2)).tolist() == [
      True, True, False, False, False]
  # Mass before each token: 0, .5, .7, .85, .95 -> top_p .7 keeps 3 tokens.
  assert keep(sampling.filter_logits(logits, top_p=0.7)).tolist() == [
      True, True, False, False, False]
  assert keep(sampling.filter_logits(logits, top_p=0.71)).tolist() == [
      True, True, True, False, False]
  # The most likely token always survives.
  assert keep(sampling.filter_logits(logits, top_p=0.01)).sum() == 1
  np.testing.assert_allclose(sampling.filter_logits(logits, temperature=2.0),
                             logits / 2.0, rtol=1e-6)


@pytest.fixture(scope="module")
def tiny_t5():
  config = t5.T5Config(vocab_size=16, emb_dim=16, num_heads=2,
                       num_encoder_layers=1, num_decoder_layers=1, head_dim=8,
                       mlp_dim=32)
  model = t5.T5(config)
  prompt = jnp.array([[3, 4, 5, 1]], jnp.int32)
  params = model.init(jax.random.PRNGKey(1), prompt, prompt[:, :2])["params"]
  params = jax.tree.map(lambda x: x * 3.0, params)  # a peakier distribution
  return model, params, prompt


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 4, 1.0), (1.3, 0, 0.8)])
def test_first_token_frequencies_follow_filtered_softmax(tiny_t5, temperature,
                                                         top_k, top_p):
  model, params, prompt = tiny_t5
  n = 20000
  prompts = jnp.repeat(prompt, n, axis=0)
  out = jax.jit(lambda p, x, r: sampling.sample_encoder_decoder(
      model, p, x, r, 1, temperature=temperature, top_k=top_k, top_p=top_p))(
          params, prompts, jax.random.PRNGKey(7))
  logits = model.apply({"params": params}, prompt,
                       jnp.zeros((1, 1), jnp.int32))[0, 0]
  probs = np.asarray(jax.nn.softmax(
      sampling.filter_logits(logits, temperature, top_k, top_p)), np.float64)
  counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=16)
  assert counts[probs < 1e-12].sum() == 0  # filtered tokens never drawn
  expected = probs * n
  seen = expected > 5
  chi2 = np.sum((counts[seen] - expected[seen]) ** 2 / expected[seen])
  # 99.9% quantile of chi-square with up to 15 degrees of freedom is 37.7.
  assert chi2 < 37.7, (counts, expected)
  # The returned log-prob is that of the drawn token under this distribution.
  np.testing.assert_allclose(out.logprobs[:, 0],
                             np.log(probs[np.asarray(out.tokens[:, 0])]),
                             rtol=1e-4, atol=1e-5)


def test_truncation_after_first_eos_and_has_eos(tiny_t5):
  model, params, prompt = tiny_t5
  out = sampling.sample_encoder_decoder(model, params,
                                        jnp.repeat(prompt, 64, axis=0),
                                        jax.random.PRNGKey(3), 6,
                                        temperature=2.0)
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  for row, m, ended in zip(tokens, mask, np.asarray(out.has_eos)):
    eos = np.flatnonzero(row == 1)
    assert ended == (eos.size > 0)
    if eos.size:
      assert eos.size == 1 and (row[eos[0] + 1:] == 0).all()
      assert m.tolist() == [1.0] * (eos[0] + 1) + [0.0] * (5 - eos[0])
    else:
      assert m.all()
  assert np.all(np.asarray(out.logprobs)[mask == 0] == 0)
