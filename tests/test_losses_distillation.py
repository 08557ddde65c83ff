"""Tests for GKD's generalised JSD (jaxrlhf/losses/distillation.py).

Truths used: the KL divergences and the generalised JSD of GKD's equation 1,
beta KL(P || M) + (1 - beta) KL(Q || M) with M = beta P + (1 - beta) Q
(P the teacher, Q the student), written out in numpy in float64; a
3-token example worked by hand; the closed-form gradients of the two KLs
with respect to the student's logits; and the paper's limit
JSD(beta) / beta -> KL(P || Q) as beta -> 0.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.losses import distillation

BATCH, LENGTH, VOCAB = 2, 5, 7


def _np_softmax(logits, temperature=1.0):
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def _np_kl(p, q):
  """sum_v p_v log(p_v / q_v) over the last axis."""
  return np.sum(p * (np.log(p) - np.log(q)), axis=-1)


def _np_jsd(p, q, beta):
  """Equation 1, the mixture formed from the probabilities themselves."""
  m = beta * p + (1 - beta) * q
  return beta * _np_kl(p, m) + (1 - beta) * _np_kl(q, m)


def _logits(seed=0, scale=2.0):
  rng = np.random.default_rng(seed)
  student = rng.normal(scale=scale, size=(BATCH, LENGTH, VOCAB))
  teacher = rng.normal(scale=scale, size=(BATCH, LENGTH, VOCAB))
  mask = np.ones((BATCH, LENGTH))
  mask[0, 3:] = 0
  mask[1, 4:] = 0
  return (student.astype(np.float32), teacher.astype(np.float32),
          mask.astype(np.float32))


def _loss(student, teacher, mask, beta, temperature=1.0):
  return float(distillation.generalized_jsd_loss(
      jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(mask), beta,
      temperature))


def _np_masked_mean(values, mask):
  return np.sum(values * mask) / np.sum(mask)


def test_beta_zero_is_forward_kl_teacher_to_student():
  student, teacher, mask = _logits()
  p, q = _np_softmax(teacher), _np_softmax(student)
  expected = _np_masked_mean(_np_kl(p, q), mask)
  np.testing.assert_allclose(_loss(student, teacher, mask, 0.0), expected,
                             rtol=1e-5)
  # Not the other direction (the draw makes the two differ by far more).
  assert abs(expected - _np_masked_mean(_np_kl(q, p), mask)) > 1e-2


def test_beta_one_is_reverse_kl_student_to_teacher():
  student, teacher, mask = _logits(1)
  p, q = _np_softmax(teacher), _np_softmax(student)
  np.testing.assert_allclose(_loss(student, teacher, mask, 1.0),
                             _np_masked_mean(_np_kl(q, p), mask), rtol=1e-5)


@pytest.mark.parametrize("beta", [0.5, 0.1, 0.3, 0.9])
def test_interior_beta_is_the_generalised_jsd_of_the_mixture(beta):
  student, teacher, mask = _logits(2)
  p, q = _np_softmax(teacher), _np_softmax(student)
  np.testing.assert_allclose(_loss(student, teacher, mask, beta),
                             _np_masked_mean(_np_jsd(p, q, beta), mask),
                             rtol=1e-5)


def test_beta_one_half_is_symmetric():
  """JSD(1/2) is the symmetric Jensen-Shannon divergence: swapping the two
  models gives the same number."""
  student, teacher, mask = _logits(3)
  np.testing.assert_allclose(_loss(student, teacher, mask, 0.5),
                             _loss(teacher, student, mask, 0.5), rtol=1e-5)
  # And it is at most log 2.
  assert _loss(student, teacher, mask, 0.5) <= math.log(2)


def test_a_three_token_example_by_hand():
  """Teacher P = (1/2, 1/4, 1/4), student Q = (1/8, 1/8, 3/4):
    KL(P || Q) = 1/2 ln 4 + 1/4 ln 2 + 1/4 ln(1/3) = 1.25 ln 2 - 0.25 ln 3
               = 0.591781
    KL(Q || P) = 1/8 ln(1/4) + 1/8 ln(1/2) + 3/4 ln 3 = 0.75 ln 3 - 0.375 ln 2
               = 0.564029
    beta = 1/2: M = (5/16, 3/16, 1/2),
      KL(P || M) = 1/2 ln(8/5) + 1/4 ln(4/3) + 1/4 ln(1/2) = 0.133636
      KL(Q || M) = 1/8 ln(2/5) + 1/8 ln(2/3) + 3/4 ln(3/2) = 0.138879
      JSD = (0.133636 + 0.138879) / 2 = 0.136257
  Logits are the log-probabilities plus a constant per model (the softmax
  ignores it)."""
  teacher = np.log([[[0.5, 0.25, 0.25]]]) + 3.0
  student = np.log([[[1 / 8, 1 / 8, 3 / 4]]]) - 1.0
  mask = np.ones((1, 1))
  ln = math.log
  forward = 1.25 * ln(2) - 0.25 * ln(3)
  reverse = 0.75 * ln(3) - 0.375 * ln(2)
  jsd = 0.5 * (0.5 * ln(8 / 5) + 0.25 * ln(4 / 3) + 0.25 * ln(1 / 2)) + 0.5 * (
      ln(2 / 5) / 8 + ln(2 / 3) / 8 + 0.75 * ln(3 / 2))
  np.testing.assert_allclose([forward, reverse, jsd],
                             [0.591781, 0.564029, 0.136257], atol=2e-6)
  for beta, expected in ((0.0, forward), (1.0, reverse), (0.5, jsd)):
    np.testing.assert_allclose(_loss(student, teacher, mask, beta), expected,
                               rtol=1e-5)


def test_masked_positions_do_not_count():
  student, teacher, mask = _logits(4)
  wild_student, wild_teacher = student.copy(), teacher.copy()
  wild_student[mask == 0] = 50.0 * np.random.default_rng(9).normal(
      size=wild_student[mask == 0].shape)
  wild_teacher[mask == 0] = -wild_student[mask == 0]
  for beta in (0.0, 0.5, 1.0):
    np.testing.assert_allclose(_loss(wild_student, wild_teacher, mask, beta),
                               _loss(student, teacher, mask, beta), rtol=1e-6)
  # Fractional weights weigh; an empty mask gives 0.
  weights = mask * np.linspace(0.1, 1.0, LENGTH)[None, :]
  p, q = _np_softmax(teacher), _np_softmax(student)
  np.testing.assert_allclose(_loss(student, teacher, weights, 0.3),
                             _np_masked_mean(_np_jsd(p, q, 0.3), weights),
                             rtol=1e-5)
  assert _loss(student, teacher, np.zeros_like(mask), 0.5) == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_temperature_divides_both_logits(beta):
  student, teacher, mask = _logits(5)
  temperature = 2.5
  p = _np_softmax(teacher, temperature)
  q = _np_softmax(student, temperature)
  expected = {0.0: _np_kl(p, q), 1.0: _np_kl(q, p)}.get(beta)
  if expected is None:
    expected = _np_jsd(p, q, beta)
  got = _loss(student, teacher, mask, beta, temperature)
  np.testing.assert_allclose(got, _np_masked_mean(expected, mask), rtol=1e-5)
  assert abs(got - _loss(student, teacher, mask, beta)) > 1e-3


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_identical_distributions_give_zero(beta):
  student, _, mask = _logits(6)
  # The same distribution with logits shifted per position.
  teacher = student + 4.0
  assert abs(_loss(student, teacher, mask, beta)) < 1e-6


def test_the_ends_are_the_scaled_limits_of_the_jsd():
  """Equation 1 goes to 0 at the ends; JSD(beta) / beta -> KL(P || Q) as
  beta -> 0 (the paper's remark), and symmetrically JSD(beta) / (1 - beta)
  -> KL(Q || P) as beta -> 1: the ends are these limits."""
  student, teacher, mask = _logits(7, scale=1.0)
  eps = 1e-3
  np.testing.assert_allclose(_loss(student, teacher, mask, eps) / eps,
                             _loss(student, teacher, mask, 0.0), rtol=2e-2)
  np.testing.assert_allclose(_loss(student, teacher, mask, 1 - eps) / eps,
                             _loss(student, teacher, mask, 1.0), rtol=2e-2)


def test_gradients_are_the_kls_closed_forms_and_finite_at_the_ends():
  """d KL(P || softmax(z / T)) / dz = (Q - P) / T and
  d KL(softmax(z / T) || P) / dz = Q (log Q - log P - KL(Q || P)) / T, per
  position, times mask / sum(mask); the teacher gets no gradient."""
  student, teacher, mask = _logits(8)
  temperature = 1.5
  p = _np_softmax(teacher, temperature)
  q = _np_softmax(student, temperature)
  scale = (mask / mask.sum())[..., None] / temperature
  forward = (q - p) * scale
  kl_qp = _np_kl(q, p)[..., None]
  reverse = q * (np.log(q) - np.log(p) - kl_qp) * scale
  for beta, expected in ((0.0, forward), (1.0, reverse)):
    grad_s, grad_t = jax.grad(
        distillation.generalized_jsd_loss, argnums=(0, 1))(
            jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(mask),
            beta, temperature)
    np.testing.assert_allclose(grad_s, expected, atol=1e-6)
    assert not np.any(grad_t)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_extreme_and_minus_infinite_logits_stay_finite(beta):
  """Probabilities that underflow to 0, and a token both models rule out
  with logit -inf (a padded vocabulary), add nothing and give no NaN."""
  student, teacher, mask = _logits(10, scale=60.0)
  student[..., -1] = -np.inf
  teacher[..., -1] = -np.inf
  value, grad = jax.value_and_grad(distillation.generalized_jsd_loss)(
      jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(mask), beta)
  assert np.isfinite(value) and value > 0
  assert np.all(np.isfinite(grad))
  trimmed = _loss(student[..., :-1], teacher[..., :-1], mask, beta)
  np.testing.assert_allclose(value, trimmed, rtol=1e-5)


def _projections(seed=11, emb_s=4, emb_t=3):
  rng = np.random.default_rng(seed)
  w_s = jnp.asarray(rng.normal(size=(emb_s, VOCAB)), jnp.float32)
  w_t = jnp.asarray(rng.normal(size=(emb_t, VOCAB)), jnp.float32)
  h_s = jnp.asarray(rng.normal(size=(BATCH, LENGTH, emb_s)), jnp.float32)
  h_t = jnp.asarray(rng.normal(size=(BATCH, LENGTH, emb_t)), jnp.float32)
  return w_s, w_t, h_s, h_t


@pytest.mark.parametrize("beta,chunk", [(0.0, 2), (0.5, 3), (1.0, 1),
                                        (0.3, None), (0.7, 5)])
def test_chunked_from_hidden_is_the_loss_of_the_whole_logits(beta, chunk):
  """Chunks of positions (5 positions in chunks of 2 and 3 need padding)
  give the loss of the whole logits and the same gradients for the
  student's output layer and states; the teacher's get none."""
  w_s, w_t, h_s, h_t = _projections()
  _, _, mask = _logits()
  mask = jnp.asarray(mask)
  temperature = 1.3

  def chunked(w_s, h_s, w_t, h_t):
    return distillation.generalized_jsd_from_hidden(
        lambda h: h @ w_s, h_s, lambda h: h @ w_t, h_t, mask, beta,
        temperature, chunk)

  def whole(w_s, h_s, w_t, h_t):
    return distillation.generalized_jsd_loss(h_s @ w_s, h_t @ w_t, mask, beta,
                                             temperature)

  value, grads = jax.value_and_grad(chunked, argnums=(0, 1, 2, 3))(
      w_s, h_s, w_t, h_t)
  ref_value, ref_grads = jax.value_and_grad(whole, argnums=(0, 1, 2, 3))(
      w_s, h_s, w_t, h_t)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for got, want in zip(grads[:2], ref_grads[:2]):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  assert not np.any(grads[2]) and not np.any(grads[3])


def test_chunks_keep_the_whole_logits_out_of_memory():
  """With a vocabulary large against everything else, the gradient's
  temporary memory in chunks of 8 positions is a fraction of the whole
  [batch, length, vocab] float32 logits (which one model's logits alone
  would take in full)."""
  batch, length, emb, vocab = 2, 256, 8, 4096
  w = jnp.zeros((emb, vocab), jnp.float32)
  h = jnp.zeros((batch, length, emb), jnp.float32)
  mask = jnp.ones((batch, length), jnp.float32)

  def temp_bytes(chunk):
    def loss(w, h):
      return distillation.generalized_jsd_from_hidden(
          lambda x: x @ w, h, lambda x: x @ (w + 1), h, mask, 0.5, 1.0, chunk)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, h).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  logits_bytes = 4 * batch * length * vocab
  chunked = temp_bytes(8)
  assert chunked < logits_bytes / 4, (chunked, logits_bytes)
  assert temp_bytes(None) > logits_bytes


def test_bad_options_are_refused_in_one_line():
  student, teacher, mask = (jnp.asarray(x) for x in _logits())
  with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
    distillation.generalized_jsd_loss(student, teacher, mask, 1.5)
  with pytest.raises(ValueError, match="beta must be a Python number"):
    distillation.generalized_jsd_loss(student, teacher, mask, jnp.float32(0.5))
  with pytest.raises(ValueError, match="temperature must be > 0"):
    distillation.generalized_jsd_loss(student, teacher, mask, 0.5, 0.0)
  with pytest.raises(ValueError, match="teacher logits"):
    distillation.generalized_jsd_loss(student, teacher[..., :3], mask, 0.5)
  with pytest.raises(ValueError, match="mask"):
    distillation.generalized_jsd_loss(student, teacher, mask[:, :2], 0.5)
  with pytest.raises(ValueError, match="chunk must be >= 1"):
    distillation.generalized_jsd_from_hidden(
        lambda h: h, student, lambda h: h, teacher, mask, 0.5, 1.0, 0)
