"""EOS handling, KL estimators, KL-penalised rewards and KL controllers."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import rl
from jaxrlhf.rl import kl as kl_lib

EOS, PAD = 1, 0

# Hand-made responses: EOS first; EOS in the middle; no EOS; several EOS.
TOKENS = np.array([
    [1, 5, 6, 7],
    [5, 6, 1, 9],
    [5, 6, 7, 8],
    [5, 1, 7, 1],
], np.int32)


def test_truncate_after_eos_hand_made():
  truncated, mask, has_eos = jax.jit(rl.truncate_after_eos)(TOKENS)
  np.testing.assert_array_equal(truncated, [
      [1, 0, 0, 0],
      [5, 6, 1, 0],
      [5, 6, 7, 8],
      [5, 1, 0, 0],
  ])
  np.testing.assert_array_equal(mask, [
      [1, 0, 0, 0],
      [1, 1, 1, 0],
      [1, 1, 1, 1],
      [1, 1, 0, 0],
  ])
  np.testing.assert_array_equal(has_eos, [True, True, False, True])
  np.testing.assert_array_equal(rl.last_token_index(mask), [0, 2, 3, 1])


def test_truncate_keeps_sampled_pad_before_eos_and_custom_ids():
  # A sampled id equal to pad before the EOS is still a real token.
  tokens = np.array([[0, 4, 9, 4, 4]], np.int32)
  truncated, mask, has_eos = rl.truncate_after_eos(tokens, eos_id=9, pad_id=3)
  np.testing.assert_array_equal(truncated, [[0, 4, 9, 3, 3]])
  np.testing.assert_array_equal(mask, [[1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(has_eos, [True])


def test_score_replacement_for_missing_eos():
  _, mask, has_eos = rl.truncate_after_eos(TOKENS)
  scores = jnp.array([0.5, 2.0, 3.0, -0.25])
  np.testing.assert_allclose(rl.replace_score_without_eos(scores, has_eos),
                             [0.5, 2.0, -1.0, -0.25])
  np.testing.assert_allclose(
      rl.replace_score_without_eos(scores, has_eos, penalty=-3.5),
      [0.5, 2.0, -3.5, -0.25])


def test_score_read_at_last_real_token_for_prompt_prefixed_mask():
  # Decoder-only layout: 2 prompt tokens, then the response.
  mask = np.array([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
  per_token = np.arange(10, dtype=np.float32).reshape(2, 5)
  np.testing.assert_array_equal(rl.last_token_index(mask), [3, 4])
  np.testing.assert_allclose(rl.score_at_last_token(per_token, mask), [3, 9])


def test_per_token_rewards_hand_computed():
  logprobs = jnp.array([[-1.0, -2.0, -0.5, -9.0], [-0.1, -0.2, -0.3, -0.4]])
  ref_logprobs = jnp.array([[-1.5, -1.0, -0.5, 0.0], [-0.1, -0.7, -0.3, 0.1]])
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])
  scores = jnp.array([2.0, -1.0])
  rewards, kl = rl.per_token_rewards(scores, logprobs, ref_logprobs, mask,
                                     kl_coef=0.1, estimator="k1")
  # k1 = log pi - log pi_ref on real tokens, 0 after the end.
  np.testing.assert_allclose(kl, [[0.5, -1.0, 0.0, 0.0],
                                  [0.0, 0.5, 0.0, -0.5]], atol=1e-6)
  np.testing.assert_allclose(rewards, [[-0.05, 0.1, 2.0, 0.0],
                                       [0.0, -0.05, 0.0, -1.0 + 0.05]],
                             atol=1e-6)


def test_kl_penalized_sequence_rewards_hand_computed():
  logprobs = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
  ref_logprobs = jnp.array([[-2.0, -2.5, 0.0], [-1.0, -2.0, -3.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 1]])
  out = rl.kl_penalized_sequence_rewards(jnp.array([1.0, 0.0]), logprobs,
                                         ref_logprobs, mask, kl_coef=0.5)
  # KL_seq = 1 + 0.5 = 1.5 and 0 + 1 + 2 = 3.
  np.testing.assert_allclose(out, [1.0 - 0.75, -1.5], atol=1e-6)


def _random_categorical(rng, size, scale):
  logits = rng.normal(size=size) * scale
  p = np.exp(logits - logits.max())
  return p / p.sum()


@pytest.mark.parametrize("seed,scale", [(0, 0.3), (1, 1.0), (2, 3.0)])
def test_kl_estimators_expectations_by_exact_enumeration(seed, scale):
  rng = np.random.default_rng(seed)
  pi = _random_categorical(rng, 7, scale)
  pi_ref = _random_categorical(rng, 7, scale)
  true_kl = float(np.sum(pi * np.log(pi / pi_ref)))   # KL(pi || pi_ref)
  # Each outcome x is one "sample"; weighting by pi(x) is the exact E_pi.
  logp, logq = jnp.log(jnp.asarray(pi)), jnp.log(jnp.asarray(pi_ref))
  expect = {e: float(np.sum(pi * np.asarray(kl_lib.kl_estimate(logp, logq, e),
                                            np.float64)))
            for e in ("k1", "k2", "k3")}
  np.testing.assert_allclose(expect["k1"], true_kl, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(expect["k3"], true_kl, rtol=1e-4, atol=1e-6)
  half_sq_log_ratio = 0.5 * float(np.sum(pi * np.log(pi_ref / pi) ** 2))
  np.testing.assert_allclose(expect["k2"], half_sq_log_ratio, rtol=1e-4)
  assert expect["k2"] >= 0


def test_k2_is_close_to_kl_for_nearby_policies():
  rng = np.random.default_rng(3)
  pi = _random_categorical(rng, 9, 1.0)
  pi_ref = pi * np.exp(0.02 * rng.normal(size=9))
  pi_ref /= pi_ref.sum()
  true_kl = np.sum(pi * np.log(pi / pi_ref))
  k2 = np.asarray(kl_lib.kl_estimate(jnp.log(pi), jnp.log(pi_ref), "k2"),
                  np.float64)
  # The bias of k2 is third order in the log-ratio: small relative to KL.
  np.testing.assert_allclose(np.sum(pi * k2), true_kl, rtol=0.05)


def test_k3_and_k2_nonnegative_pointwise_k1_is_not():
  rng = np.random.default_rng(4)
  logp = jnp.asarray(rng.normal(size=1000) * 3)
  logq = jnp.asarray(rng.normal(size=1000) * 3)
  assert float(jnp.min(kl_lib.kl_estimate(logp, logq, "k3"))) >= 0
  assert float(jnp.min(kl_lib.kl_estimate(logp, logq, "k2"))) >= 0
  assert float(jnp.min(kl_lib.kl_estimate(logp, logq, "k1"))) < 0


def test_k3_hand_value_and_direction():
  # pi = 0.5, pi_ref = 0.25: r = pi_ref / pi = 0.5, k3 = (r - 1) - log r.
  out = kl_lib.kl_estimate(jnp.log(jnp.array([0.5])),
                           jnp.log(jnp.array([0.25])), "k3")
  np.testing.assert_allclose(out, [-0.5 + math.log(2.0)], rtol=1e-6)


def test_unknown_estimator_is_a_clear_error():
  with pytest.raises(ValueError, match="estimator='k4'"):
    kl_lib.kl_estimate(jnp.zeros(3), jnp.zeros(3), "k4")


def test_adaptive_kl_controller_direction_and_exact_update():
  update = jax.jit(functools.partial(rl.adaptive_kl_coef, target=6.0,
                                     horizon=10000.0))
  # KL 8 > 6: error (8-6)/6 = 1/3 clipped to 0.2; 0.1 * (1 + 0.2*512/10000).
  up = update(0.1, 8.0, 512)
  np.testing.assert_allclose(up, 0.1 * 1.01024, rtol=1e-6)
  # KL 5.7 < 6: error -0.05 (not clipped); 0.1 * (1 - 0.05*512/10000).
  down = update(0.1, 5.7, 512)
  np.testing.assert_allclose(down, 0.1 * (1 - 0.00256), rtol=1e-6)
  assert float(up) > 0.1 > float(down)
  assert float(update(0.1, 6.0, 512)) == pytest.approx(0.1)
