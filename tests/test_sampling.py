"""The sampler draws from the softmax of the filtered logits."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import registry
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
  # Random parameters without compiling the initialisers (LeCun-scaled
  # kernels); the first-token distribution has several likely tokens
  # (largest probabilities 0.17, 0.15, 0.13, 0.13).
  abstract = nn.meta.unbox(jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(1), prompt, prompt[:, :2]))[
          "params"])
  rng = np.random.default_rng(2)
  params = jax.tree.map(
      lambda a: (rng.standard_normal(a.shape) / np.sqrt(a.shape[0])
                 ).astype(np.float32) if a.ndim > 1 else np.ones(a.shape,
                                                                 np.float32),
      abstract)
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
  logits = jax.jit(model.apply)({"params": params}, prompt,
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


# ----------------------------------------------------------------------------
# The decoder-only sampler (KV cache: a prefill, then one step per token).

HF_LLAMA = __import__("pathlib").Path(__file__).resolve().parent / (
    "fixtures/hf/llama_gqa")


@pytest.fixture(scope="module")
def tiny_llama():
  from jaxrlhf.models import hf_io  # pylint: disable=g-import-not-at-top
  config, params = hf_io.load_hf_checkpoint(HF_LLAMA)
  model = registry.module_for_config(config)
  # Left-padded by 2: rotary positions must come from the mask.
  prompt = jnp.array([[0, 0, 5, 9, 12]], jnp.int32)
  return model, params, prompt, (prompt > 0).astype(jnp.int32)


def _full_forward_probs(model, params, tokens, temperature, top_k, top_p):
  """Filtered next-token probabilities after `tokens` [1, L] (no cache)."""
  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models.layers import rotary
  mask = (jnp.arange(tokens.shape[1]) >= 2).astype(jnp.int32)[None]
  logits = jax.jit(model.apply)({"params": params}, tokens,
                                rotary.positions_from_mask(mask), mask)[0, -1]
  return np.asarray(jax.nn.softmax(
      sampling.filter_logits(logits, temperature, top_k, top_p)), np.float64)


def _chi2_ok(counts, probs):
  n = counts.sum()
  assert counts[probs < 1e-12].sum() == 0  # filtered tokens never drawn
  expected = probs * n
  seen = expected > 5
  chi2 = np.sum((counts[seen] - expected[seen]) ** 2 / expected[seen])
  # 99.9% quantile of chi-square with up to 63 degrees of freedom is 103.4.
  return chi2 < 103.4


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 10, 1.0),
                                                      (1.2, 0, 0.9)])
def test_decoder_only_first_and_second_token_frequencies(
    tiny_llama, temperature, top_k, top_p):
  model, params, prompt, mask = tiny_llama
  n = 20000
  out = sampling.sample_decoder_only(
      model, params, jnp.repeat(prompt, n, axis=0), jnp.repeat(mask, n, 0),
      jax.random.PRNGKey(11), 2, temperature=temperature, top_k=top_k,
      top_p=top_p, eos_id=-1)
  tokens = np.asarray(out.tokens)
  first = _full_forward_probs(model, params, prompt, temperature, top_k, top_p)
  assert _chi2_ok(np.bincount(tokens[:, 0], minlength=64), first)
  # The second token (drawn after one cached step) follows the full-forward
  # distribution given the prompt and the most frequent first token.
  a = int(np.argmax(np.bincount(tokens[:, 0], minlength=64)))
  second = _full_forward_probs(
      model, params, jnp.concatenate([prompt, jnp.array([[a]])], 1),
      temperature, top_k, top_p)
  rows = tokens[:, 0] == a
  assert rows.sum() > 1000
  assert _chi2_ok(np.bincount(tokens[rows, 1], minlength=64), second)
  # Returned log-probs are those of the filtered distributions.
  np.testing.assert_allclose(out.logprobs[:, 0],
                             np.log(first[tokens[:, 0]]), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.logprobs)[rows, 1],
                             np.log(second[tokens[rows, 1]]), rtol=1e-4,
                             atol=1e-5)


def test_sampling_option_errors():
  with pytest.raises(ValueError, match="top_p"):
    sampling._check_options(4, 1.0, 0, 0.0)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="max_new_tokens"):
    sampling._check_options(0, 1.0, 0, 1.0)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="temperature"):
    sampling._check_options(4, -1.0, 0, 1.0)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="num_samples"):
    sampling._check_options(  # pylint: disable=protected-access
        4, 1.0, 0, 1.0, num_samples=0)
  with pytest.raises(ValueError, match="cache_segments"):
    sampling._check_options(  # pylint: disable=protected-access
        4, 1.0, 0, 1.0, cache_segments=0)


def test_cache_segments_default_to_two_for_long_generations_on_a_gpu():
  """Unset, the segments are 2 where they were measured to pay (a GPU,
  generations of LONG_GENERATION tokens or more), else 1."""
  assert sampling.LONG_GENERATION == 2048  # the length measured on an H100
  assert sampling.default_cache_segments(2048, "gpu") == 2
  assert sampling.default_cache_segments(8192, "gpu") == 2
  assert sampling.default_cache_segments(2047, "gpu") == 1
  assert sampling.default_cache_segments(8192, "cpu") == 1
  assert sampling.default_cache_segments(8192, "tpu") == 1
  assert sampling.default_cache_segments(8192) == 1  # this CPU
  sampling._check_options(  # pylint: disable=protected-access
      4, 1.0, 0, 1.0, cache_segments=None)


def test_cache_segments_split_the_steps_evenly():
  """`segment_ends`: near-equal runs of the max_new_tokens - 1 decode steps,
  at most one per step."""
  assert sampling.segment_ends(8, 3) == (2, 4, 7)
  assert sampling.segment_ends(1025, 4) == (256, 512, 768, 1024)
  assert sampling.segment_ends(3, 5) == (1, 2)  # 2 steps: 2 segments
  assert sampling.segment_ends(1, 4) == (0,)  # no step
  for new in (1, 2, 100, 300, 5000):
    for k in (1, 2, 3, 4):
      ends = sampling.segment_ends(new, k)
      runs = np.diff((0,) + ends)
      assert ends[-1] == new - 1 and runs.max() - runs.min() <= 1
