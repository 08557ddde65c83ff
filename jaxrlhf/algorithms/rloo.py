"""RLOO (REINFORCE leave-one-out; Ahmadian et al. 2024, RLHF book 11.1.3).

The reward of a response is its score minus beta * its KL to the reference
summed over its tokens; its baseline is the mean reward of the other k - 1
responses to its prompt (unbiased: the baseline does not depend on the
response it is subtracted from).
"""

from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import kl_control
from jaxrlhf.algorithms import online
from jaxrlhf.algorithms import online_config
from jaxrlhf.algorithms import online_eval
from jaxrlhf.algorithms import online_rewards
from jaxrlhf.algorithms import policy_gradient
from jaxrlhf.rl import advantages as advantages_lib


def advantages(trainer, state, rollout):
  rewards = policy_gradient.penalized_rewards(
      trainer, rollout, kl_control.coefficient(state))
  return (advantages_lib.rloo_advantages(rewards,
                                         trainer.online.samples_per_prompt),
          state.algorithm_state, {})


ALGORITHM = base.Algorithm(
    name="rloo",
    summary="REINFORCE leave-one-out: each response's baseline is the mean "
    "KL-penalised reward of the other responses to its prompt.",
    data=base.PROMPTS,
    networks=online.POLICY_REFERENCE_AND_REWARD,
    training=online.Online(
        samples_per_prompt=4,
        # Several clipped updates per batch, as TRL's RLOO trainer does.
        num_epochs=4,
        targets=policy_gradient.make_targets(advantages),
        loss=policy_gradient.make_loss(policy_gradient.symmetric_clipping),
        loss_count=policy_gradient.make_loss_count(
            policy_gradient.symmetric_clipping)),
    carried=kl_control.carried("online.kl_coef"),
    evaluation=online_eval.EVALUATION,
    config_groups=(online_config.ONLINE, online_rewards.GROUP),
    checks=(online_config.check_online, online_config.check_groups_of_two),
    pipeline_stage=True,
)
