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
from jaxrlhf.algorithms import kl_control
from jaxrlhf.algorithms import online
from jaxrlhf.algorithms import online_config
from jaxrlhf.algorithms import online_eval
from jaxrlhf.algorithms import online_rewards
from jaxrlhf.algorithms import policy_gradient
from jaxrlhf.rl import advantages as advantages_lib
from jaxrlhf.rl import kl as kl_lib


def advantages(trainer, state, rollout):
  """[rows, L] normalised returns of the KL-penalised token rewards."""
  token_rewards, _ = kl_lib.per_token_rewards(
      rollout.scores, rollout.logprobs, rollout.ref_logprobs, rollout.mask,
      kl_control.coefficient(state), trainer.config.online.kl_estimator)
  return (advantages_lib.reinforce_pp_advantages(token_rewards, rollout.mask),
          state.algorithm_state, {})


def clipping(config) -> policy_gradient.Clipping:
  """PPO's symmetric clip, a mean over the batch's tokens, no KL term in
  the loss (it is in the reward)."""
  eps = config.online.clip_eps
  return policy_gradient.Clipping(eps, eps, "token_mean", loss_kl=False)


ALGORITHM = base.Algorithm(
    name="reinforce_pp",
    summary="REINFORCE++: token-level KL in the reward, returns normalised "
    "over the whole batch, PPO's clipped token loss, no critic.",
    data=base.PROMPTS,
    networks=online.POLICY_REFERENCE_AND_REWARD,
    training=online.Online(
        samples_per_prompt=1, num_epochs=1,
        targets=policy_gradient.make_targets(advantages),
        loss=policy_gradient.make_loss(clipping),
        loss_count=policy_gradient.make_loss_count(clipping)),
    carried=kl_control.carried("online.kl_coef"),
    evaluation=online_eval.EVALUATION,
    config_groups=(online_config.ONLINE, online_rewards.GROUP),
    checks=(online_config.check_online,),
)
