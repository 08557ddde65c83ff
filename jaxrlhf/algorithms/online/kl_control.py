"""The KL coefficient an online algorithm carries, and its controller.

PPO, RLOO and REINFORCE penalise the reward with beta * KL(pi || pi_ref)
(`config.online.kl_coef`); GRPO weighs a KL term of its loss
(`config.grpo.kl_coef`). Either coefficient is carried between steps in
`TrainState.algorithm_state["kl_coef"]` (checkpointed), fixed or moved by
Ziegler et al.'s adaptive controller (`config.online.adaptive_kl`). An
algorithm without a KL term (rejection sampling) carries none.

A step scores its samples under the reference (a forward pass) only when
the KL term weighs something (`scores_reference`): with a coefficient of 0
(DAPO, Dr. GRPO, `configs/grpo_gsm8k.py`) every KL the step would compute
is multiplied by 0, the adaptive controller keeps 0 at 0 (its update is
multiplicative), and the forward pass is skipped, as TRL (beta = 0) and
verl (no KL loss or KL reward) skip it; the run then holds no copy of the
reference either, unless it samples from it (`online.keeps_reference`).
"""

import jax.numpy as jnp

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.rl import kl as kl_lib

KL_COEF = "kl_coef"


def carried(coefficient_field: str) -> base.Carried:
  """The carried state of an algorithm whose KL weight is the config field
  `coefficient_field` ("online.kl_coef", "grpo.kl_coef")."""

  def check_adaptive_start(c) -> None:
    value = float(config_schema.get(c, coefficient_field))
    config_schema.require(
        not (c.online.adaptive_kl and value == 0.0), "online.adaptive_kl",
        f"True with {coefficient_field} = 0: the adaptive controller "
        "multiplies the coefficient, so it would stay 0 (and no step "
        f"scores the reference); set {coefficient_field} to the starting "
        "coefficient, or online.adaptive_kl to False.")

  return base.Carried(
      init=lambda config: {
          KL_COEF: float(config_schema.get(config, coefficient_field))},
      checks=(check_adaptive_start,))


def scores_reference(algorithm, config) -> bool:
  """Whether a step needs the reference's log-probs of its samples: the
  algorithm carries a KL coefficient and the config sets it to something
  other than 0. When not, `Rollout.ref_logprobs` holds the sampling
  policy's log-probs (every KL reads 0) and the "kl" metric is left out."""
  initial = algorithm.carried.init(config).get(KL_COEF)
  return initial is not None and float(initial) != 0.0


def coefficient(state):
  """The carried KL coefficient, or None for an algorithm without one."""
  return state.algorithm_state.get(KL_COEF)


def next_coefficient(config, kl_coef, rollout):
  """The coefficient of the next step: unchanged, or Ziegler et al.'s
  adaptive update from the rollout's mean per-response KL."""
  o = config.online
  if not o.adaptive_kl:
    return kl_coef
  observed = jnp.mean(kl_lib.sequence_kl(rollout.logprobs,
                                         rollout.ref_logprobs, rollout.mask,
                                         "k1"))
  return kl_lib.adaptive_kl_coef(kl_coef, observed, rollout.mask.shape[0],
                                 o.kl_target, o.kl_horizon)
