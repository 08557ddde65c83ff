"""REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for
Aligning Large Language Models"): REINFORCE with PPO's token-level tricks
and no critic.

The KL to the reference is in the reward, token by token (r_t = -beta *
KL_t, plus the score at the last token: `online.kl_coef`,
`online.kl_estimator`); each token's advantage is its return, normalised
over every token of the batch instead of against a value or a per-prompt
baseline (`jaxrlhf.rl.advantages.reinforce_pp_advantages`); the update is
PPO's clipped surrogate per token, averaged over the batch's tokens.
"""

from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.algorithms.online import recipe
from jaxrlhf.algorithms.online import options
from jaxrlhf.algorithms.online import reward_model_eval
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import teacher
from jaxrlhf.algorithms.online import critic_free
from jaxrlhf.rl import advantages as advantages_lib
from jaxrlhf.rl import kl as kl_lib


def advantages(trainer, state, rollout):
  """[rows, L] normalised returns of the KL-penalised token rewards."""
  token_rewards, _ = kl_lib.per_token_rewards(
      rollout.scores, rollout.logprobs, rollout.ref_logprobs, rollout.mask,
      kl_control.coefficient(state), trainer.config.online.kl_estimator)
  return (advantages_lib.reinforce_pp_advantages(token_rewards, rollout.mask),
          state.algorithm_state, {})


def clipping(config) -> critic_free.Clipping:
  """PPO's symmetric clip, a mean over the batch's tokens, no KL term in
  the loss (it is in the reward)."""
  eps = config.online.clip_eps
  return critic_free.Clipping(eps, eps, "token_mean", loss_kl=False)


ALGORITHM = base.Algorithm(
    name="reinforce_pp",
    summary="REINFORCE++: token-level KL in the reward, returns normalised "
    "over the whole batch, PPO's clipped token loss, no critic.",
    data=base.PROMPTS,
    networks=recipe.POLICY_REFERENCE_AND_REWARD,
    training=recipe.Online(
        samples_per_prompt=1, num_epochs=1,
        targets=critic_free.make_targets(advantages),
        loss=critic_free.make_loss(clipping),
        loss_count=critic_free.make_loss_count(clipping)),
    carried=kl_control.carried("online.kl_coef"),
    evaluation=reward_model_eval.EVALUATION,
    config_groups=(options.ONLINE, reward_sources.GROUP, teacher.GROUP),
    checks=(options.check_online,),
)
