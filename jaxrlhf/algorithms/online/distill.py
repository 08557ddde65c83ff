"""On-policy distillation (`algorithm='distill'`) and GKD (`algorithm='gkd'`):
the online step whose only signal is a frozen teacher's (`teacher`, which
also serves the term any other online algorithm adds).

  distill  the student samples; the teacher's per-token reverse KL to it
           trains it, as advantages (Thinking Machines' on-policy
           distillation) or as a loss over the vocabulary
           (`distill.mode`).
  gkd      Agarwal et al. 2024 (GKD, Algorithm 1): the generalised JSD
           (`gkd.beta`) on the student's samples in a share `gkd.lmbda` of
           steps and on the dataset's completions in the others.
"""

import jax.numpy as jnp

from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.algorithms.online import critic_free
from jaxrlhf.algorithms.online import options
from jaxrlhf.algorithms.online import recipe
from jaxrlhf.algorithms.online import teacher


def _clipping(config) -> critic_free.Clipping:
  """A token mean (each token answers for itself), symmetric clipping."""
  o = config.online
  return critic_free.Clipping(o.clip_eps, o.clip_eps, "token_mean",
                              loss_kl=False)


def _no_reward_advantages(trainer, state, rollout):
  """No rewards: every advantage is the teacher's (`with_distill_targets`)."""
  del trainer
  return (jnp.zeros(rollout.mask.shape, jnp.float32), state.algorithm_state,
          {})


_policy_gradient = critic_free.make_loss(_clipping)


def _loss(trainer, params, minibatch, algorithm_state):
  """The policy gradient of the teacher's advantages, or nothing in mode
  'loss', whose divergence `with_distill_loss` adds."""
  if teacher.mode(trainer.config) == "loss":
    return jnp.zeros((), jnp.float32), {}
  return _policy_gradient(trainer, params, minibatch, algorithm_state)


def _online(samples: bool) -> recipe.Online:
  return recipe.Online(
      samples_per_prompt=1, num_epochs=1,
      targets=critic_free.make_targets(_no_reward_advantages),
      loss=_loss, loss_count=critic_free.make_loss_count(_clipping),
      trains_on_rewards=False,
      sample=None if samples else teacher.gkd_sample,
      reads_completions=not samples)


_CHECKS = (options.check_sampling,)

# Judged as every policy is, against the reference (`policy_eval`): no
# reward model to read.
_EVALUATION = base.Evaluation(
    evaluate=policy_eval.against_reference,
    describe=policy_eval.describe_against_reference,
    check=policy_eval.check_eval_task)

DISTILL = base.Algorithm(
    name=teacher.DISTILL,
    summary="On-policy distillation: the student samples, a frozen teacher "
    "scores every sampled token, and the student follows the per-token "
    "reverse KL to it (as advantages, or as a loss over the vocabulary).",
    data=base.PROMPTS,
    networks=recipe.POLICY_REFERENCE_AND_REWARD,
    training=_online(samples=True),
    evaluation=_EVALUATION,
    config_groups=(options.ONLINE, teacher.GROUP),
    checks=_CHECKS,
)

GKD = base.Algorithm(
    name=teacher.GKD,
    summary="Generalised knowledge distillation: the generalised JSD to a "
    "frozen teacher on the student's samples (a share lambda of steps) "
    "and the dataset's completions (the rest).",
    data=base.PROMPTS,
    networks=recipe.POLICY_REFERENCE_AND_REWARD,
    training=_online(samples=False),
    evaluation=_EVALUATION,
    config_groups=(options.ONLINE, teacher.GROUP, teacher.GKD_GROUP),
    checks=_CHECKS,
)

ALGORITHMS = (DISTILL, GKD)
