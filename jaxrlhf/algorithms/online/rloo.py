"""RLOO (REINFORCE leave-one-out; Ahmadian et al. 2024, RLHF book 11.1.3).

The reward of a response is its score minus beta * its KL to the reference
summed over its tokens; its baseline is the mean reward of the other k - 1
responses to its prompt (unbiased: the baseline does not depend on the
response it is subtracted from).
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


def advantages(trainer, state, rollout):
  rewards = critic_free.penalized_rewards(
      rollout, kl_control.coefficient(state),
      trainer.config.online.kl_estimator)
  return (advantages_lib.rloo_advantages(rewards,
                                         trainer.online.samples_per_prompt),
          state.algorithm_state, {})


ALGORITHM = base.Algorithm(
    name="rloo",
    summary="REINFORCE leave-one-out: each response's baseline is the mean "
    "KL-penalised reward of the other responses to its prompt.",
    data=base.PROMPTS,
    networks=recipe.POLICY_REFERENCE_AND_REWARD,
    training=recipe.Online(
        samples_per_prompt=4,
        # Several clipped updates per batch, as TRL's RLOO trainer does.
        num_epochs=4,
        targets=critic_free.make_targets(advantages),
        loss=critic_free.make_loss(critic_free.symmetric_clipping),
        loss_count=critic_free.make_loss_count(
            critic_free.symmetric_clipping)),
    carried=kl_control.carried("online.kl_coef"),
    evaluation=reward_model_eval.EVALUATION,
    config_groups=(options.ONLINE, reward_sources.GROUP, teacher.GROUP),
    checks=(options.check_online, options.check_groups_of_two),
    pipeline_stage=True,
)
