"""PPO, GRPO and REINFORCE losses, their gradients and metrics."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import rl

EPS = 0.2


def test_ppo_policy_clipping_hand_cases_and_zero_gradients():
  # (ratio, advantage): above 1+eps with A>0 -> clipped, no gradient;
  # above 1+eps with A<0 -> unclipped (the pessimistic term), gradient;
  # below 1-eps with A>0 -> unclipped, gradient; below 1-eps with A<0 ->
  # clipped, no gradient; inside the range -> plain -A * ratio.
  ratios = np.array([1.5, 1.5, 0.5, 0.5, 1.1])
  advantages = jnp.array([[2.0, -2.0, 2.0, -2.0, 1.0]])
  old_logprobs = jnp.log(jnp.array([[0.3, 0.2, 0.1, 0.4, 0.25]]))
  logprobs = old_logprobs + jnp.log(jnp.asarray(ratios))[None]
  mask = jnp.ones((1, 5))

  def loss_fn(lp):
    return rl.ppo_policy_loss(lp, old_logprobs, advantages, mask, EPS)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs)
  per_token = np.array([-2.4, 3.0, -1.0, 1.6, -1.1])
  np.testing.assert_allclose(loss, per_token.mean(), rtol=1e-5)
  # d(-A * ratio)/d logprob = -A * ratio on the unclipped tokens, 0 else.
  np.testing.assert_allclose(grad, [[0.0, 3.0, -1.0, 0.0, -1.1]] / np.array(5),
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics["clip_fraction"], 2 / 5)
  log_ratio = np.log(ratios)
  np.testing.assert_allclose(metrics["approx_kl_k1"], np.mean(-log_ratio),
                             rtol=1e-5)
  np.testing.assert_allclose(metrics["approx_kl_k3"],
                             np.mean(ratios - 1 - log_ratio), rtol=1e-5)


def test_value_clipping_hand_cases():
  old_values = jnp.ones((1, 3))
  values = jnp.array([[1.5, 0.9, 1.5]])
  returns = jnp.array([[2.0, 2.0, 0.0]])
  mask = jnp.ones((1, 3))
  # 1) moved +0.5 towards R=2: clipped V=1.2 has the larger error 0.64 ->
  #    constant, no gradient. 2) inside the clip range: (0.9-2)^2 = 1.21.
  # 3) moved away from R=0: unclipped error 2.25 > 1.44, gradient 2*1.5.
  def loss_fn(v):
    return rl.ppo_value_loss(v, old_values, returns, mask, clip_eps=EPS)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(values)
  np.testing.assert_allclose(loss, 0.5 * (0.64 + 1.21 + 2.25) / 3, rtol=1e-5)
  np.testing.assert_allclose(grad, [[0.0, 0.5 * 2 * -1.1 / 3,
                                     0.5 * 2 * 1.5 / 3]], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics["value_clip_fraction"], 1 / 3)
  np.testing.assert_allclose(metrics["value_error"], (0.25 + 1.21 + 2.25) / 3,
                             rtol=1e-5)
  unclipped, _ = rl.ppo_value_loss(values, old_values, returns, mask,
                                   clip_eps=None)
  np.testing.assert_allclose(unclipped, 0.5 * (0.25 + 1.21 + 2.25) / 3,
                             rtol=1e-5)


def test_ppo_with_ratio_one_gives_the_vanilla_policy_gradient():
  """One epoch, one minibatch: grad of PPO loss = -E[A grad log pi]."""
  rng = np.random.default_rng(0)
  num_states, num_actions, batch, length = 3, 4, 5, 6
  theta = jnp.asarray(rng.normal(size=(num_states, num_actions)), jnp.float32)
  states = rng.integers(0, num_states, size=(batch, length))
  actions = rng.integers(0, num_actions, size=(batch, length))
  advantages = rng.normal(size=(batch, length)).astype(np.float32)
  mask = np.zeros((batch, length), np.float32)
  for b, n in enumerate(rng.integers(1, length + 1, size=batch)):
    mask[b, :n] = 1

  def logprobs_of(params):
    return jax.nn.log_softmax(params)[states, actions]

  old_logprobs = logprobs_of(theta)   # the rollout policy is the same policy

  def ppo_objective(params):
    return rl.ppo_policy_loss(logprobs_of(params), old_logprobs, advantages,
                              mask, EPS)[0]

  grad = np.asarray(jax.grad(ppo_objective)(theta), np.float64)
  # Softmax policy: grad_theta[s] log pi(a|s) = onehot(a) - pi(.|s).
  pi = np.asarray(jax.nn.softmax(theta), np.float64)
  want = np.zeros((num_states, num_actions))
  for b in range(batch):
    for t in range(length):
      if mask[b, t]:
        s, a = states[b, t], actions[b, t]
        want[s] -= advantages[b, t] * (np.eye(num_actions)[a] - pi[s])
  want /= mask.sum()
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)


def test_explained_variance_and_entropy_against_numpy():
  rng = np.random.default_rng(1)
  values = rng.normal(size=(3, 5)).astype(np.float32)
  returns = (values + 0.3 * rng.normal(size=(3, 5))).astype(np.float32)
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
  r, v = returns[mask > 0], values[mask > 0]
  np.testing.assert_allclose(rl.explained_variance(values, returns, mask),
                             1 - np.var(r - v) / np.var(r), rtol=1e-4)
  np.testing.assert_allclose(rl.explained_variance(values, values, mask), 1.0)
  logits = rng.normal(size=(2, 3, 7))
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(rl.entropy_from_logits(jnp.asarray(logits)),
                             -(p * np.log(p)).sum(-1), rtol=1e-5)


def test_ppo_loss_combines_terms():
  rng = np.random.default_rng(2)
  shape = (2, 4)
  arrays = [jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(6)]
  logprobs, old_logprobs, advantages, values, old_values, returns = arrays
  mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1]])
  entropy = jnp.asarray(rng.uniform(size=shape), jnp.float32)
  loss, metrics = jax.jit(rl.ppo_loss)(
      logprobs, old_logprobs, advantages, values, old_values, returns, mask,
      vf_coef=0.1, entropy=entropy, entropy_coef=0.01)
  want = (metrics["policy_loss"] + 0.1 * metrics["value_loss"]
          - 0.01 * float(jnp.sum(entropy * mask) / 6))
  np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_ppo_rollout_targets_properties():
  rng = np.random.default_rng(3)
  batch, length = 4, 6
  logprobs = jnp.asarray(-rng.uniform(size=(batch, length)), jnp.float32)
  ref_logprobs = jnp.asarray(-rng.uniform(size=(batch, length)), jnp.float32)
  values = jnp.asarray(rng.normal(size=(batch, length)), jnp.float32)
  _, mask, has_eos = rl.truncate_after_eos(
      jnp.array([[5, 1, 0, 0, 0, 0], [5, 5, 5, 1, 0, 0],
                 [5, 5, 5, 5, 5, 5], [1, 0, 0, 0, 0, 0]]))
  scores = rl.replace_score_without_eos(jnp.array([0.5, 1.0, 9.0, -2.0]),
                                        has_eos)
  targets = rl.ppo_rollout_targets(scores, logprobs, ref_logprobs, values,
                                   mask, kl_coef=0.05)
  fmask = np.asarray(mask, np.float64)
  # Summed per-token rewards = score - beta * KL_seq (detail 22, Figure 11).
  np.testing.assert_allclose(
      np.sum(np.asarray(targets["rewards"]) * fmask, axis=1),
      rl.kl_penalized_sequence_rewards(scores, logprobs, ref_logprobs, mask,
                                       0.05), rtol=1e-5)
  advantages = np.asarray(targets["advantages"])[fmask > 0]
  np.testing.assert_allclose(advantages.mean(), 0.0, atol=1e-5)
  np.testing.assert_allclose(advantages.std(), 1.0, rtol=1e-4)
  # With gamma = lam = 1 the returns are the reward-to-go.
  targets = rl.ppo_rollout_targets(scores, logprobs, ref_logprobs, values,
                                   mask, kl_coef=0.05, lam=1.0)
  rewards = np.asarray(targets["rewards"])
  reward_to_go = np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1] * fmask
  np.testing.assert_allclose(targets["returns"], reward_to_go, rtol=1e-5,
                             atol=1e-6)


# A ragged batch: response lengths 1 and 3; the 100s are padding.
RAGGED_LOSS = jnp.array([[1.0, 100.0, 100.0], [2.0, 3.0, 7.0]])
RAGGED_MASK = jnp.array([[1, 0, 0], [1, 1, 1]])


@pytest.mark.parametrize("reduction,max_length,want", [
    ("sequence_mean", None, (1.0 + 12.0 / 3) / 2),
    ("token_mean", None, 13.0 / 4),
    ("constant_length", 4, 13.0 / (2 * 4)),
    ("constant_length", None, 13.0 / (2 * 3)),
    ("sequence_sum", None, (1.0 + 12.0) / 2),
])
def test_loss_reductions_on_ragged_batch(reduction, max_length, want):
  reduce = jax.jit(rl.reduce_token_losses,
                   static_argnames=("reduction", "max_length"))
  np.testing.assert_allclose(
      reduce(RAGGED_LOSS, RAGGED_MASK, reduction=reduction,
             max_length=max_length), want, rtol=1e-6)


@pytest.mark.parametrize("reduction,want", [
    ("sequence_mean", (-1.0 + 2.0) / 2),
    ("token_mean", (-1.0 + 6.0) / 4),
    ("constant_length", (-1.0 + 6.0) / (2 * 4)),
])
def test_grpo_reductions_at_ratio_one(reduction, want):
  logprobs = jnp.log(jnp.array([[0.5, 0.1, 0.1, 0.1], [0.2, 0.3, 0.4, 0.1]]))
  mask = jnp.array([[1, 0, 0, 0], [1, 1, 1, 0]])
  # pi = pi_old = pi_ref: the loss is -A averaged per the reduction.
  loss, metrics = rl.clipped_policy_gradient_loss(
      logprobs, logprobs, logprobs, jnp.array([1.0, -2.0]), mask,
      kl_coef=0.04, reduction=reduction, max_length=4)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_allclose(metrics["loss_kl_k3"], 0.0, atol=1e-7)


def test_grpo_asymmetric_clipping_and_k3_term():
  old_logprobs = jnp.log(jnp.array([[0.4, 0.4]]))
  logprobs = jnp.log(jnp.array([[0.5, 0.3]]))          # ratios 1.25, 0.75
  ref_logprobs = jnp.log(jnp.array([[0.25, 0.3]]))     # k3 = log 2 - 1/2, 0
  advantages = jnp.array([[1.0, -1.0]])
  mask = jnp.ones((1, 2))
  k3 = math.log(2.0) - 0.5
  grpo = functools.partial(rl.clipped_policy_gradient_loss, logprobs,
                           old_logprobs, ref_logprobs, advantages, mask,
                           kl_coef=0.1, reduction="token_mean")
  # eps_high = 0.28 lets 1.25 through; the 0.75 < 0.8 token with A < 0 is
  # clipped to 0.8.
  loss, metrics = grpo(clip_eps_low=0.2, clip_eps_high=0.28)
  np.testing.assert_allclose(loss, (-1.25 + 0.1 * k3 + 0.8) / 2, rtol=1e-5)
  np.testing.assert_allclose(metrics["clip_fraction"], 0.5)
  np.testing.assert_allclose(metrics["loss_kl_k3"], k3 / 2, rtol=1e-5)
  loss, metrics = grpo(clip_eps_low=0.2, clip_eps_high=0.2)
  np.testing.assert_allclose(loss, (-1.2 + 0.1 * k3 + 0.8) / 2, rtol=1e-5)
  np.testing.assert_allclose(metrics["clip_fraction"], 1.0)


def test_grpo_kl_term_gradient_pulls_towards_reference():
  # d k3 / d log pi = 1 - pi_ref / pi: positive when pi > pi_ref, so gradient
  # descent lowers log pi there.
  logprobs = jnp.log(jnp.array([[0.5, 0.1]]))
  ref_logprobs = jnp.log(jnp.array([[0.25, 0.4]]))
  mask = jnp.ones((1, 2))
  grad = jax.grad(lambda lp: rl.clipped_policy_gradient_loss(
      lp, logprobs, ref_logprobs, jnp.zeros(1), mask, kl_coef=0.1,
      reduction="token_mean")[0])(logprobs)
  np.testing.assert_allclose(grad, [[0.1 * (1 - 0.5) / 2,
                                     0.1 * (1 - 4.0) / 2]], rtol=1e-5)


def test_one_update_of_the_clipped_surrogate_is_the_policy_gradient():
  """REINFORCE and RLOO train with the clipped surrogate (jaxrlhf.algorithms.online.critic_free): with
  the sampling policy's own log-probs the ratio is 1 and the gradient is
  the REINFORCE estimator -A grad log pi(y|x) (RLHF book 11.1.1)."""
  logprobs = jnp.array([[-1.0, -2.0, -5.0], [-0.5, -5.0, -5.0]])
  mask = jnp.array([[1, 1, 0], [1, 0, 0]])
  advantages = jnp.array([2.0, -1.0])
  grad = jax.grad(lambda lp: rl.clipped_policy_gradient_loss(
      lp, jax.lax.stop_gradient(lp), logprobs, advantages, mask, kl_coef=0.0,
      reduction="sequence_sum")[0])(logprobs)
  # -A d log pi(y|x) / d log pi(y_t): -2 on row 0's two tokens, +1 on row
  # 1's one, averaged over the batch of 2.
  np.testing.assert_allclose(grad, [[-1.0, -1.0, 0.0], [0.5, 0.0, 0.0]])


def test_bad_shapes_and_options_are_clear_errors():
  with pytest.raises(ValueError, match="shapes must match"):
    rl.ppo_policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)),
                       jnp.zeros((2, 4)), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="reduction='mean'"):
    rl.reduce_token_losses(RAGGED_LOSS, RAGGED_MASK, reduction="mean")
  with pytest.raises(ValueError, match="advantages has shape"):
    rl.clipped_policy_gradient_loss(
        jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(3),
        jnp.ones((2, 3)))


def _ragged_case():
  """Two responses of 3 and 2 tokens, the second with an importance ratio
  far outside any clip range."""
  old = np.log(np.array([[0.4, 0.3, 0.2], [0.5, 0.2, 0.9]]))
  logprobs = old + np.array([[0.1, -0.05, 0.02], [0.6, 0.5, 7.0]])
  mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
  return (jnp.asarray(logprobs, jnp.float32), jnp.asarray(old, jnp.float32),
          jnp.asarray(mask))


@pytest.mark.parametrize("advantages", [(1.5, 2.0), (-1.5, -2.0)])
def test_gspo_sequence_ratio_against_its_formula(advantages):
  """GSPO (Zheng et al. 2025, eq. 5-7; TRL importance_sampling_level
  "sequence"): s_i = exp(mean_t log(pi/pi_old)) per response, the
  surrogate -min(s_i A_i, clip(s_i, 1-eps, 1+eps) A_i) at each of its
  tokens, so with a sequence mean the loss is the batch mean of that and a
  token's gradient is -A_i s_i / |y_i| / B when the clip lets s_i through,
  0 when it does not."""
  logprobs, old, mask = _ragged_case()
  a = np.array(advantages)
  eps_low, eps_high = 0.1, 0.12
  lengths = np.asarray(mask).sum(-1)
  s = np.exp((np.asarray(logprobs - old) * np.asarray(mask)).sum(-1)
             / lengths)                                # [1.024, 1.7333]
  clipped_s = np.clip(s, 1 - eps_low, 1 + eps_high)
  per_response = -np.minimum(s * a, clipped_s * a)
  passes = (s * a <= clipped_s * a)                    # min picks s: gradient

  (loss, metrics), grad = jax.value_and_grad(
      lambda lp: rl.clipped_policy_gradient_loss(
          lp, old, old, jnp.asarray(a, jnp.float32), mask,
          clip_eps_low=eps_low, clip_eps_high=eps_high,
          reduction="sequence_mean", ratio_level="sequence"),
      has_aux=True)(logprobs)
  np.testing.assert_allclose(loss, per_response.mean(), rtol=1e-5)
  want = np.where(passes, -a * s / lengths / 2, 0.0)[:, None] * np.asarray(
      mask)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
  # Only the sequence's ratio matters: the token ratios of row 0 (1.105,
  # 0.951, 1.020) straddle 1, its sequence ratio 1.024 is inside the range.
  clipped_tokens = np.asarray(mask)[:, :] * (~passes)[:, None]
  np.testing.assert_allclose(metrics["clip_fraction"],
                             clipped_tokens.sum() / np.asarray(mask).sum())


def test_gspo_and_the_token_ratio_agree_on_one_token_responses():
  # A response of one token has its token's ratio as its sequence ratio.
  logprobs = jnp.log(jnp.array([[0.5], [0.2]]))
  old = jnp.log(jnp.array([[0.4], [0.3]]))
  args = (logprobs, old, old, jnp.array([1.0, -1.0]), jnp.ones((2, 1)))
  token, _ = rl.clipped_policy_gradient_loss(*args)
  sequence, _ = rl.clipped_policy_gradient_loss(*args, ratio_level="sequence")
  np.testing.assert_allclose(token, sequence, rtol=1e-6)


def test_cispo_against_its_formula():
  """CISPO (MiniMax-M1 2025, eq. 4; TRL loss_type "cispo"): per token
  -sg(min(r_t, eps_max)) A log pi_t, averaged over the batch's tokens. The
  weight is a constant: every token has gradient -min(r_t, eps_max) A / N,
  the capped ones included (PPO-clip would drop those)."""
  logprobs, old, mask = _ragged_case()
  a = np.array([1.0, -0.5])
  cap = 1.5
  r = np.exp(np.asarray(logprobs - old))
  weight = np.minimum(r, cap)
  m = np.asarray(mask)
  n = m.sum()
  (loss, metrics), grad = jax.value_and_grad(
      lambda lp: rl.clipped_policy_gradient_loss(
          lp, old, old, jnp.asarray(a, jnp.float32), mask, clip_eps_high=cap,
          reduction="token_mean", objective="cispo"),
      has_aux=True)(logprobs)
  want_loss = (-weight * a[:, None] * np.asarray(logprobs) * m).sum() / n
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, -weight * a[:, None] * m / n, rtol=1e-5,
                             atol=1e-7)
  assert np.all(np.abs(np.asarray(grad))[m > 0] > 0)
  # Row 1's first two tokens (ratios e^0.6, e^0.5 > 1.5) are capped, but A
  # < 0 there: the cap binds only on positive advantages (TRL's metric).
  np.testing.assert_allclose(metrics["clip_fraction"], 0.0)
  _, metrics = rl.clipped_policy_gradient_loss(
      logprobs, old, old, jnp.array([1.0, 0.5]), mask, clip_eps_high=cap,
      reduction="token_mean", objective="cispo")
  np.testing.assert_allclose(metrics["clip_fraction"], 2 / 5)
