"""Tests for DRO-V (jaxrlhf/losses/dro_losses.py).

Truths used: the closed-form optimum of equation 2 computed in numpy, and
equations 7 and 8 of the DRO paper written out by hand in numpy.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.losses import dro_losses

NUM_PROMPTS, NUM_COMPLETIONS = 3, 4


def _numpy_optimum(ref_logp, rewards, tau):
  """Equation 2: pi* = pi_ref e^{r/tau} / e^{V*/tau}.

  V* = tau log E_{y~pi_ref} e^{r/tau}.
  """
  v_star = tau * np.log(np.sum(np.exp(ref_logp) * np.exp(rewards / tau),
                               axis=1))
  log_pi_star = ref_logp + rewards / tau - v_star[:, None] / tau
  return log_pi_star, v_star


def _bandit(seed=0):
  rng = np.random.default_rng(seed)
  ref_logits = rng.normal(size=(NUM_PROMPTS, NUM_COMPLETIONS))
  ref_logp = ref_logits - np.log(np.sum(np.exp(ref_logits), 1, keepdims=True))
  rewards = rng.normal(size=(NUM_PROMPTS, NUM_COMPLETIONS))
  other_behaviour = rng.dirichlet(np.ones(NUM_COMPLETIONS), size=NUM_PROMPTS)
  return ref_logp, rewards, other_behaviour


def _train_tabular(ref_logp, rewards, behaviour, tau, steps=4000):
  """Minimise DRO-V on a tabular bandit with the exact expectation.

  The batch holds every (prompt, completion) once, weighted by
  rho(x) mu(y|x) with rho uniform: the full expectation of equation 4 under
  the behaviour policy mu. Policy logits and per-prompt values are separate
  parameter sets with separate optimizers, both updated from the gradient of
  policy_loss + value_loss (the stop-gradients must route eq. 8 to the policy
  and eq. 7 to the value); the policy's update is multiplied by 1/tau, as
  DRO-V does (section 3.3).
  """
  weights = (behaviour / NUM_PROMPTS).reshape(-1).astype(np.float32)
  prompt_of = np.repeat(np.arange(NUM_PROMPTS), NUM_COMPLETIONS)

  def total_loss(params):
    logp = jax.nn.log_softmax(params["logits"], axis=-1).reshape(-1)
    policy_loss, value_loss, metrics = dro_losses.dro_v_losses(
        logp, ref_logp.reshape(-1), params["values"][prompt_of],
        rewards.reshape(-1), tau=tau, weights=weights)
    return policy_loss + value_loss, metrics

  optimizer = optax.multi_transform(
      {"policy": optax.chain(optax.sgd(0.3), optax.scale(1 / tau)),
       "value": optax.sgd(0.5)},
      {"logits": "policy", "values": "value"})
  params = {"logits": jnp.zeros((NUM_PROMPTS, NUM_COMPLETIONS)),
            "values": jnp.zeros((NUM_PROMPTS,))}

  def step(carry, _):
    params, opt_state = carry
    grads, metrics = jax.grad(total_loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), metrics[
        "dro_loss"]

  run = jax.jit(lambda carry: jax.lax.scan(step, carry, None, length=steps))
  (params, _), losses = run((params, optimizer.init(params)))
  return (np.asarray(jax.nn.log_softmax(params["logits"], -1)),
          np.asarray(params["values"]), np.asarray(losses))


@pytest.mark.parametrize("tau", [0.5, 2.0])
def test_tabular_bandit_reaches_closed_form_optimum(tau):
  ref_logp, rewards, other_behaviour = _bandit()
  log_pi_star, v_star = _numpy_optimum(ref_logp, rewards, tau)
  solutions = []
  # Offline data from pi_ref itself and from an unrelated full-support
  # behaviour policy: Theorem 1 says both have the same unique optimum.
  for behaviour in (np.exp(ref_logp), other_behaviour):
    log_pi, values, losses = _train_tabular(ref_logp, rewards, behaviour, tau)
    np.testing.assert_allclose(log_pi, log_pi_star, atol=2e-4)
    np.testing.assert_allclose(values, v_star, atol=2e-4)
    assert losses[-1] < 1e-8
    solutions.append(log_pi)
  np.testing.assert_allclose(solutions[0], solutions[1], atol=3e-4)


def test_tabular_bandit_without_full_support_is_not_identified():
  """Theorem 1 needs supp(mu) = supp(pi_ref): drop one completion and the loss
  still reaches 0 but the policy is no longer pinned to pi*."""
  tau = 1.0
  ref_logp, rewards, _ = _bandit(seed=1)
  behaviour = np.exp(ref_logp)
  behaviour[:, 0] = 0.0
  behaviour /= behaviour.sum(1, keepdims=True)
  log_pi_star, _ = _numpy_optimum(ref_logp, rewards, tau)
  log_pi, _, losses = _train_tabular(ref_logp, rewards, behaviour, tau)
  assert losses[-1] < 1e-6
  assert np.max(np.abs(log_pi - log_pi_star)) > 1e-2


def _random_inputs(seed, batch=6):
  rng = np.random.default_rng(seed)
  return tuple(rng.normal(size=batch).astype(np.float32) for _ in range(4))


@pytest.mark.parametrize("tau", [0.3, 1.0, 2.5])
def test_gradients_equal_equations_7_and_8(tau):
  policy_logps, ref_logps, values, rewards = _random_inputs(0)
  batch = policy_logps.shape[0]

  def policy_loss(p, v):
    return dro_losses.dro_v_losses(p, ref_logps, v, rewards, tau=tau)[0]

  def value_loss(p, v):
    return dro_losses.dro_v_losses(p, ref_logps, v, rewards, tau=tau)[1]

  # Hand-written (batch-mean, Algorithm 1) eq. 8 with grad_theta log pi = 1 per
  # coordinate: -tau/B [(r - V) - tau/2 * 2 l]. DRO-V's 1/tau rescaling is
  # applied to the update by the optimizer, not here.
  log_ratio = policy_logps - ref_logps
  eq8 = -tau / batch * ((rewards - values) - tau / 2 * 2 * log_ratio)
  eq7 = 1 / batch * (values - rewards + tau * log_ratio)

  g_policy, g_policy_v = jax.grad(policy_loss, argnums=(0, 1))(policy_logps,
                                                               values)
  g_value_p, g_value = jax.grad(value_loss, argnums=(0, 1))(policy_logps,
                                                            values)
  np.testing.assert_allclose(g_policy, eq8, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_value, eq7, rtol=1e-5, atol=1e-6)
  # No cross-talk: the policy loss never moves V, the value loss never moves pi.
  np.testing.assert_array_equal(g_policy_v, np.zeros(batch))
  np.testing.assert_array_equal(g_value_p, np.zeros(batch))


def test_policy_gradient_is_gradient_of_equation_4():
  tau = 0.7
  policy_logps, ref_logps, values, rewards = _random_inputs(1)

  def equation_4(p):
    return 0.5 * jnp.mean(jnp.square(rewards - values - tau * (p - ref_logps)))

  expected = jax.grad(equation_4)(policy_logps)
  got = jax.grad(lambda p: dro_losses.dro_v_losses(
      p, ref_logps, values, rewards, tau=tau)[0])(policy_logps)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_value_loss_and_metrics_by_hand():
  tau = 2.0
  policy_logps = np.array([-1.0, -2.0], np.float32)
  ref_logps = np.array([-1.5, -1.0], np.float32)
  values = np.array([0.5, -0.5], np.float32)
  rewards = np.array([1.0, 0.0], np.float32)
  # residuals r - V - tau l: 1 - 0.5 - 2*0.5 = -0.5 ; 0 + 0.5 - 2*(-1) = 2.5
  _, value_loss, metrics = dro_losses.dro_v_losses(policy_logps, ref_logps, values,
                                            rewards, tau=tau)
  expected = 0.5 * (0.25 + 6.25) / 2
  np.testing.assert_allclose(value_loss, expected, rtol=1e-6)
  np.testing.assert_allclose(metrics["dro_loss"], expected, rtol=1e-6)
  np.testing.assert_allclose(metrics["residual_abs_mean"], 1.5, rtol=1e-6)
  np.testing.assert_allclose(metrics["advantage_mean"], 0.5, rtol=1e-6)
  np.testing.assert_allclose(metrics["log_ratio_mean"], -0.25, rtol=1e-6)


def test_weights_drop_padding_examples():
  policy_logps, ref_logps, values, rewards = _random_inputs(2, batch=5)
  weights = np.array([1, 1, 1, 0, 0], np.float32)
  full = dro_losses.dro_v_losses(policy_logps, ref_logps, values, rewards, tau=1.5,
                          weights=weights)
  head = dro_losses.dro_v_losses(policy_logps[:3], ref_logps[:3], values[:3],
                          rewards[:3], tau=1.5)
  np.testing.assert_allclose(full[0], head[0], rtol=1e-6)
  np.testing.assert_allclose(full[1], head[1], rtol=1e-6)


def test_single_value_per_batch():
  tau = 1.3
  policy_logps, ref_logps, values, rewards = _random_inputs(3)
  batch = policy_logps.shape[0]
  log_ratio = policy_logps - ref_logps
  # A scalar V shared by the batch: eq. 7 summed over examples (batch mean).
  scalar_v = np.float32(0.4)
  grad_scalar = jax.grad(lambda v: dro_losses.dro_v_losses(
      policy_logps, ref_logps, v, rewards, tau=tau)[1])(scalar_v)
  np.testing.assert_allclose(
      grad_scalar, np.mean(scalar_v - rewards + tau * log_ratio), rtol=1e-5)
  # Per-example outputs averaged into one V per batch.
  shared_v = values.mean()
  grad_values = jax.grad(lambda v: dro_losses.dro_v_losses(
      policy_logps, ref_logps, v, rewards, tau=tau,
      single_value_per_batch=True)[1])(values)
  expected = np.full(batch, np.mean(shared_v - rewards + tau * log_ratio)
                     / batch)
  np.testing.assert_allclose(grad_values, expected, rtol=1e-5, atol=1e-7)
  # The policy sees the shared value as its baseline (eq. 8).
  grad_policy = jax.grad(lambda p: dro_losses.dro_v_losses(
      p, ref_logps, values, rewards, tau=tau,
      single_value_per_batch=True)[0])(policy_logps)
  np.testing.assert_allclose(
      grad_policy, -tau * ((rewards - shared_v) - tau * log_ratio) / batch,
      rtol=1e-5, atol=1e-6)


def test_jit_matches_eager():
  inputs = _random_inputs(4)
  fn = functools.partial(dro_losses.dro_v_losses, tau=0.8)
  eager = fn(*inputs)
  jitted = jax.jit(fn)(*inputs)
  np.testing.assert_allclose(eager[0], jitted[0], rtol=1e-6)
  np.testing.assert_allclose(eager[1], jitted[1], rtol=1e-6)


def test_optimal_policy_and_value_matches_numpy():
  ref_logp, rewards, _ = _bandit(seed=5)
  log_pi_star, v_star = _numpy_optimum(ref_logp, rewards, 0.6)
  got_log_pi, got_v = dro_losses.optimal_policy_and_value(ref_logp, rewards, tau=0.6)
  np.testing.assert_allclose(got_log_pi, log_pi_star, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_v, v_star, rtol=1e-5, atol=1e-6)


def test_bad_input_errors():
  p = np.zeros(4, np.float32)
  with pytest.raises(ValueError, match="values must be"):
    dro_losses.dro_v_losses(p, p, np.zeros(3), p)
  with pytest.raises(ValueError, match="sequence_logprob"):
    dro_losses.dro_v_losses(np.zeros((4, 2)), p, p, p)
  with pytest.raises(ValueError, match="shapes must match"):
    dro_losses.dro_v_losses(p, np.zeros(5), p, p)
  with pytest.raises(ValueError, match="tau"):
    dro_losses.dro_v_losses(p, p, p, p, tau=0.0)
