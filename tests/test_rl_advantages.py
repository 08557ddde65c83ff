"""GAE, whitening, RLOO, GRPO and REINFORCE advantages."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import rl


def gae_reference(rewards, values, mask, gamma, lam):
  """Textbook GAE, one row at a time, as an explicit sum of TD errors.

  A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l} over the episode's tokens, with
  delta_s = r_s + gamma V_{s+1} - V_s and V = 0 after the last token.
  """
  batch, length = rewards.shape
  advantages = np.zeros((batch, length))
  returns = np.zeros((batch, length))
  for b in range(batch):
    steps = [t for t in range(length) if mask[b, t]]
    if not steps:
      continue
    end = steps[-1]

    def value(s):
      return values[b, s] if s <= end else 0.0

    for t in steps:
      total = 0.0
      for s in range(t, end + 1):
        delta = rewards[b, s] + gamma * value(s + 1) - value(s)
        total += (gamma * lam) ** (s - t) * delta
      advantages[b, t] = total
      returns[b, t] = total + values[b, t]
  return advantages, returns


def random_contiguous_mask(rng, batch, length):
  mask = np.zeros((batch, length), np.int32)
  for b in range(batch):
    start = rng.integers(0, length // 3 + 1)   # a prompt prefix, sometimes
    stop = rng.integers(start + 1, length + 1)
    mask[b, start:stop] = 1
  mask[-1] = 0                                  # one empty row
  return mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (1.0, 1.0), (0.9, 0.0),
                                       (0.99, 0.5)])
def test_gae_matches_python_reference(gamma, lam):
  rng = np.random.default_rng(int(gamma * 100 + lam * 10))
  batch, length = 6, 9
  rewards = rng.normal(size=(batch, length)).astype(np.float32)
  values = rng.normal(size=(batch, length)).astype(np.float32)
  mask = random_contiguous_mask(rng, batch, length)
  gae = jax.jit(functools.partial(rl.generalized_advantage_estimation,
                                  gamma=gamma, lam=lam))
  advantages, returns = gae(rewards, values, mask)
  want_adv, want_ret = gae_reference(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(advantages, want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(returns, want_ret, rtol=1e-5, atol=1e-5)


def test_gae_lambda_one_gamma_one_is_reward_to_go_minus_value():
  rewards = np.array([[0.0, -0.1, 2.0, 7.0]], np.float32)
  values = np.array([[1.0, 0.5, 0.25, 9.0]], np.float32)
  mask = np.array([[1, 1, 1, 0]])
  advantages, returns = rl.generalized_advantage_estimation(
      rewards, values, mask, gamma=1.0, lam=1.0)
  np.testing.assert_allclose(advantages, [[0.9, 1.4, 1.75, 0.0]], atol=1e-6)
  np.testing.assert_allclose(returns, [[1.9, 1.9, 2.0, 0.0]], atol=1e-6)


def test_reward_whitening_keeps_mean_advantage_whitening_centres():
  rng = np.random.default_rng(0)
  x = rng.normal(loc=3.0, scale=2.0, size=(4, 6)).astype(np.float32)
  mask = random_contiguous_mask(rng, 4, 6)
  mask[-1, :2] = 1
  real = x[mask > 0].astype(np.float64)
  mean, std = real.mean(), real.std()  # population std, as the paper's whiten
  white_r = np.asarray(rl.whiten_rewards(x, mask))
  white_a = np.asarray(rl.whiten_advantages(x, mask))
  np.testing.assert_allclose(white_r[mask > 0], (real - mean) / std + mean,
                             rtol=1e-4)
  np.testing.assert_allclose(white_a[mask > 0], (real - mean) / std,
                             rtol=1e-4, atol=1e-5)
  assert np.all(white_r[mask == 0] == 0) and np.all(white_a[mask == 0] == 0)


def test_rloo_advantages_hand_computed():
  rewards = jnp.array([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 4.0])
  out = jax.jit(rl.rloo_advantages, static_argnums=1)(rewards, 4)
  # Prompt 1: baselines 11/3, 10/3, 9/3, 6/3. Prompt 2: 4/3, 4/3, 4/3, 0.
  np.testing.assert_allclose(
      out, [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0, -4 / 3, -4 / 3, -4 / 3, 4.0],
      rtol=1e-6, atol=1e-6)


def test_rloo_with_kl_folded_into_sequence_reward():
  scores = jnp.array([1.0, 3.0])
  logprobs = jnp.array([[-1.0, -1.0], [-1.0, -1.0]])
  ref_logprobs = jnp.array([[-2.0, -3.0], [-1.0, -1.0]])  # KL_seq = 3, 0
  mask = jnp.ones((2, 2))
  seq_rewards = rl.kl_penalized_sequence_rewards(scores, logprobs,
                                                 ref_logprobs, mask, 0.5)
  np.testing.assert_allclose(seq_rewards, [-0.5, 3.0], rtol=1e-6)
  np.testing.assert_allclose(rl.rloo_advantages(seq_rewards, 2), [-3.5, 3.5],
                             rtol=1e-6)


def test_grpo_advantages_hand_computed():
  rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
  out = rl.grpo_advantages(rewards, 4)
  # Group 1: mean 0.5, unbiased std sqrt(1/3). Group 2: all equal -> 0.
  a = 0.5 / (np.sqrt(1 / 3) + 1e-4)
  np.testing.assert_allclose(out, [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-5)
  biased = rl.grpo_advantages(rewards, 4, unbiased_std=False)
  np.testing.assert_allclose(biased[:4], np.array([1, -1, -1, 1]) * 0.5 /
                             (0.5 + 1e-4), rtol=1e-5)
  dr_grpo = rl.grpo_advantages(rewards, 4, scale_by_std=False)
  np.testing.assert_allclose(dr_grpo, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_group_layout_errors_are_clear():
  with pytest.raises(ValueError, match="group_size=3"):
    rl.grpo_advantages(jnp.zeros(8), 3)
  with pytest.raises(ValueError, match="at least 2"):
    rl.rloo_advantages(jnp.zeros(8), 1)


def test_reinforce_baselines():
  rewards = jnp.array([1.0, 2.0, 6.0])
  np.testing.assert_allclose(
      rl.reinforce_advantages(rewards, rl.batch_mean_baseline(rewards)),
      [-2.0, -1.0, 3.0])
  running = rl.update_running_mean(1.0, rewards, decay=0.75)
  np.testing.assert_allclose(running, 0.75 * 1.0 + 0.25 * 3.0)
  np.testing.assert_allclose(rl.reinforce_advantages(rewards, running),
                             [-0.5, 0.5, 4.5])


def test_reinforce_pp_advantages_are_returns_normalised_over_the_batch():
  """REINFORCE++ (Hu 2025, eqs. 2-3): G_t = sum_{s>=t} r_s of the token
  rewards, then (G - mean) / std over every response token of the batch
  (not per prompt, not per response). Loops over a ragged batch."""
  rng = np.random.default_rng(3)
  token_rewards = rng.normal(size=(3, 5)).astype(np.float32)
  lengths = [5, 2, 3]
  mask = np.zeros((3, 5), np.float32)
  for b, n in enumerate(lengths):
    mask[b, :n] = 1
  returns = []
  for b, n in enumerate(lengths):
    for t in range(n):
      returns.append(sum(token_rewards[b, s] for s in range(t, n)))
  returns = np.array(returns)
  mean, std = returns.mean(), returns.std()
  got = np.asarray(rl.reinforce_pp_advantages(jnp.asarray(token_rewards),
                                              jnp.asarray(mask)))
  i = 0
  for b, n in enumerate(lengths):
    for t in range(5):
      if t < n:
        np.testing.assert_allclose(got[b, t], (returns[i] - mean) / std,
                                   rtol=1e-4, atol=1e-5)
        i += 1
      else:
        assert got[b, t] == 0.0
