"""The generalised Jensen-Shannon divergence of GKD, a student's next-token
distribution against a teacher's.

Generalised Knowledge Distillation (Agarwal et al. 2024, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes",
equation 1, among its preliminaries on KL-based divergences; TRL's
GKDTrainer cites the same equation) measures, at every position, with P the
teacher's and Q the student's next-token distribution,

  JSD(beta)(P || Q) = beta KL(P || M) + (1 - beta) KL(Q || M),
  M = beta P + (1 - beta) Q,

so beta weights the teacher both in the mixture and in the sum. JSD(beta)
itself goes to 0 at either end (M becomes one of the two); the paper notes
JSD(beta) / beta -> KL(P || Q) as beta -> 0, and at the ends TRL's
GKDTrainer (`generalized_jsd_loss`) uses these limits, as here:

  beta = 0: forward KL(teacher || student) (mode covering),
  beta = 1: reverse KL(student || teacher) (mode seeking).

The loss is therefore not continuous at the ends: beta = 1e-6 gives about
1e-6 KL(teacher || student). Both logits are divided by the temperature
before the softmax (no temperature^2 factor, as TRL).

The teacher's logits are constants (`jax.lax.stop_gradient`): distillation
trains the student only, and the chunked form then never differentiates the
teacher's output layer.
"""

import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxrlhf.losses import common


def _check_beta(where, beta):
  """beta decides the formula (the ends are the KLs), so it must be a Python
  number in [0, 1]."""
  if not isinstance(beta, numbers.Real) or isinstance(beta, bool):
    raise ValueError(f"{where}: beta must be a Python number in [0, 1] (it "
                     f"picks the formula at 0 and 1), got {beta!r}.")
  if not 0 <= beta <= 1:
    raise ValueError(f"{where}: beta must be in [0, 1] (0: forward KL, 1: "
                     f"reverse KL), got {beta}.")


def _check_temperature(where, temperature):
  if isinstance(temperature, numbers.Real) and not temperature > 0:
    raise ValueError(f"{where}: temperature must be > 0, got {temperature}.")


def _kl(log_p, log_q):
  """KL(p || q) = sum_v p_v (log p_v - log q_v) over the last axis, with
  0 log 0 = 0 (a token of logit -inf under p adds nothing, even where q is
  also -inf there)."""
  p = jnp.exp(log_p)
  return jnp.sum(p * jnp.where(p > 0, log_p - log_q, 0.0), axis=-1)


def generalized_jsd_per_token(student_logits, teacher_logits, beta: float,
                              temperature=1.0):
  """JSD(beta)(teacher || student) at each position (see the module's
  docstring for the convention).

  Args:
    student_logits: [..., vocab].
    teacher_logits: [..., vocab], the same shape (gradient stopped).
    beta: Python number in [0, 1]; 0 forward KL(teacher || student), 1
      reverse KL(student || teacher).
    temperature: divides both logits before the softmax.
  Returns:
    [...] float32 divergences (nats), >= 0.
  """
  where = "generalized_jsd_per_token"
  _check_beta(where, beta)
  _check_temperature(where, temperature)
  if student_logits.shape != teacher_logits.shape:
    raise ValueError(f"{where}: student logits {student_logits.shape} and "
                     f"teacher logits {teacher_logits.shape} differ; give both "
                     "over the same positions and vocabulary.")
  log_q = jax.nn.log_softmax(
      student_logits.astype(jnp.float32) / temperature, axis=-1)
  log_p = jax.nn.log_softmax(
      jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / temperature,
      axis=-1)
  if beta == 0:
    return _kl(log_p, log_q)
  if beta == 1:
    return _kl(log_q, log_p)
  # log M = logsumexp(log beta + log P, log(1 - beta) + log Q), without
  # forming M's probabilities (no underflow to log 0 where both are tiny).
  # Where both are -inf (a token both rule out) M is 0 and adds nothing;
  # logaddexp's gradient there is NaN, so it reads zeros instead.
  nowhere = jnp.isneginf(log_p) & jnp.isneginf(log_q)
  log_m = jnp.where(nowhere, -jnp.inf, jnp.logaddexp(
      jnp.where(nowhere, 0.0, jnp.log(beta) + log_p),
      jnp.where(nowhere, 0.0, jnp.log1p(-beta) + log_q)))
  return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)


def generalized_jsd_loss(student_logits, teacher_logits, mask, beta: float,
                         temperature=1.0):
  """Masked mean over tokens of `generalized_jsd_per_token`.

  Args:
    student_logits: [batch, length, vocab].
    teacher_logits: [batch, length, vocab] (gradient stopped).
    mask: [batch, length], 1 on the tokens that count (fractions weigh).
    beta: Python number in [0, 1]; 0 forward KL(teacher || student), 1
      reverse KL(student || teacher).
    temperature: divides both logits before the softmax.
  Returns:
    Scalar float32: sum(mask * JSD) / sum(mask), 0 where the mask is empty.
  """
  if mask.shape != student_logits.shape[:-1]:
    raise ValueError(f"generalized_jsd_loss: mask {mask.shape} must be the "
                     f"logits' [batch, length] {student_logits.shape[:-1]}.")
  jsd = generalized_jsd_per_token(student_logits, teacher_logits, beta,
                                  temperature)
  return common.masked_mean(jsd, mask.astype(jnp.float32))


def generalized_jsd_from_hidden(
    project_student: Callable[[jax.Array], jax.Array], student_hidden,
    project_teacher: Callable[[jax.Array], jax.Array], teacher_hidden, mask,
    beta: float, temperature=1.0, chunk: Optional[int] = None):
  """`generalized_jsd_loss` of the logits `project_*(hidden)`, `chunk`
  positions at a time, so that neither model's [batch, length, vocab]
  logits exist at once.

  A `jax.lax.scan` over chunks of positions forms each chunk's logits, reads
  their divergence and drops them; the body is rematerialised
  (`jax.checkpoint`), so the backward pass forms a chunk's logits again from
  its states instead of keeping every chunk's: the step holds one chunk's
  logits of each model, at the cost of the output layers' forward matmuls
  once more. (`jaxrlhf.models.scoring.hidden_token_stats` chunks the SFT
  loss's positions in the same way.)

  Args:
    project_student: [batch, C, emb_s] states -> [batch, C, vocab] logits
      (the student's output layer, its parameters closed over and
      differentiated through).
    student_hidden: [batch, length, emb_s] the student's final states.
    project_teacher: [batch, C, emb_t] -> [batch, C, vocab] (the teacher's;
      its logits are constants).
    teacher_hidden: [batch, length, emb_t].
    mask: [batch, length], 1 on the tokens that count.
    beta: Python number in [0, 1], as `generalized_jsd_loss`.
    temperature: divides both logits before the softmax.
    chunk: positions per chunk; None or >= length: the logits at once.
  Returns:
    Scalar float32, the value of `generalized_jsd_loss` on the whole logits.
  """
  where = "generalized_jsd_from_hidden"
  batch, length = mask.shape
  for name, hidden in (("student_hidden", student_hidden),
                       ("teacher_hidden", teacher_hidden)):
    if hidden.shape[:2] != (batch, length):
      raise ValueError(f"{where}: {name} {hidden.shape} must be [batch, "
                       f"length, emb] with the mask's [batch, length] "
                       f"{mask.shape}.")
  if chunk is not None and chunk < 1:
    raise ValueError(f"{where}: chunk must be >= 1 positions (or None for "
                     f"no chunks), got {chunk}.")
  mask = mask.astype(jnp.float32)
  if chunk is None or chunk >= length:
    return generalized_jsd_loss(project_student(student_hidden),
                                project_teacher(teacher_hidden), mask, beta,
                                temperature)
  _check_beta(where, beta)
  # Chunks of equal size as near `chunk` as divides the padded length; the
  # padded positions have zero states and mask 0.
  num_chunks = -(-length // chunk)
  chunk = -(-length // num_chunks)
  padded = num_chunks * chunk

  def chunks(x):
    # [batch, length, ...] -> [num_chunks, batch, chunk, ...]
    x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
    return jnp.swapaxes(x.reshape((batch, num_chunks, chunk) + x.shape[2:]),
                        0, 1)

  @jax.checkpoint
  def chunk_sum(student_states, teacher_states, chunk_mask):
    jsd = generalized_jsd_per_token(project_student(student_states),
                                    project_teacher(teacher_states), beta,
                                    temperature)
    return common.masked_sum(jsd, chunk_mask)

  def body(total, xs):
    return total + chunk_sum(*xs), None

  total, _ = jax.lax.scan(
      body, jnp.zeros((), jnp.float32),
      (chunks(student_hidden), chunks(teacher_hidden), chunks(mask)))
  count = jnp.sum(mask)
  return total / jnp.where(count > 0, count, 1.0)
