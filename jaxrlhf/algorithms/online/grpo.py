"""GRPO (DeepSeekMath, Shao et al. 2024; RLHF book 11.1.5, 11.2.3) and the
2025 variants that are config choices of it.

Advantages are each score's deviation from its group's mean, divided by the
group std (or not: Dr. GRPO, Liu et al. 2025); the KL to the reference is a
k3 term of the loss weighted by `grpo.kl_coef` (carried between steps, so
`online.adaptive_kl` can move it), not a penalty in the reward. The
variants (`jaxrlhf.rl.policy_gradient_losses`):

  Dr. GRPO  grpo.scale_by_std=False, grpo.reduction=constant_length
  DAPO      grpo.clip_eps_high=0.28 (clip-higher), grpo.reduction=token_mean,
            grpo.kl_coef=0, grpo.dynamic_sampling=True (groups whose
            rewards all agree are dropped and more prompts sampled:
            `host_split`), rewards.overlong.weight=1 (soft overlong
            penalty)
  GSPO      grpo.ratio_level=sequence (one importance ratio per response,
            clipped per response), online.clip_eps and grpo.clip_eps_high
            ~3e-4 / 4e-4, grpo.reduction=sequence_mean
  CISPO     grpo.objective=cispo (clipped, stopped importance weights on a
            REINFORCE token loss; grpo.clip_eps_high is the weight's cap,
            e.g. 5), grpo.reduction=token_mean
"""

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.algorithms.online import recipe
from jaxrlhf.algorithms.online import options
from jaxrlhf.algorithms.online import reward_model_eval
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import teacher
from jaxrlhf.algorithms.online import critic_free
from jaxrlhf.rl import advantages as advantages_lib
from jaxrlhf.rl import policy_gradient_losses
from jaxrlhf.rl import reductions

F = config_schema.Field

GROUP = config_schema.Group(
    "grpo", "GRPO and its 2025 variants (Dr. GRPO, DAPO, GSPO, CISPO: "
    "jaxrlhf/algorithms/online/grpo.py lists their settings).", [
        F("kl_coef", 0.04,
          "beta of the k3 KL(pi || reference) term in the loss "
          "(DeepSeekMath: 0.04); 0 (DAPO, Dr. GRPO) also skips the "
          "reference's forward pass on the samples and the 'kl' metric, "
          "and the run keeps no copy of the reference (evaluation loads "
          "the starting policy when it runs).",
          bounds=">=0"),
        F("clip_eps_high", None,
          "Upper clip epsilon (DAPO's clip-higher); unset = "
          "online.clip_eps.", type=float, bounds=">0"),
        F("reduction", "sequence_mean",
          "'sequence_mean' (GRPO), 'token_mean' (DAPO), 'constant_length' "
          "(Dr. GRPO: divide by batch * online.max_new_tokens), "
          "'sequence_sum'.", choices=reductions.LOSS_REDUCTIONS),
        F("scale_by_std", True,
          "Divide the group-centred rewards by the group std (GRPO); False "
          "is Dr. GRPO's unscaled advantage."),
        F("ratio_level", "token",
          "The importance ratio: per 'token' (PPO, GRPO) or per "
          "'sequence' (GSPO: the geometric mean of the response's token "
          "ratios, clipped per response).",
          choices=policy_gradient_losses.RATIO_LEVELS),
        F("objective", "clipped",
          "'clipped' (the PPO-clip surrogate) or 'cispo' (CISPO: "
          "-sg(min(ratio, grpo.clip_eps_high)) * A * log pi per token, the "
          "weight clipped and stopped instead of the update).",
          choices=policy_gradient_losses.OBJECTIVES),
        F("dynamic_sampling", False,
          "DAPO's dynamic sampling: drop the groups whose rewards all agree "
          "(zero advantage) and sample more prompts until train.batch_size "
          "groups vary, or max_sampling_rounds rounds were sampled (dropped "
          "groups then fill the rest); logs dynamic_sampling/rounds and "
          "dynamic_sampling/dropped_fraction."),
        F("max_sampling_rounds", 3,
          "Dynamic sampling's cap of rounds of train.batch_size prompts per "
          "step (each extra round moves the prompt stream on).",
          bounds=">0"),
    ])


def clipping(config) -> critic_free.Clipping:
  o, g = config.online, config.grpo
  high = o.clip_eps if g.clip_eps_high is None else g.clip_eps_high
  return critic_free.Clipping(o.clip_eps, high, g.reduction,
                                  loss_kl=True, ratio_level=g.ratio_level,
                                  objective=g.objective)


def sampling_rounds(config):
  """The cap of dynamic sampling's rounds, or None when it is off."""
  g = config.grpo
  return g.max_sampling_rounds if g.dynamic_sampling else None


def advantages(trainer, state, rollout):
  return (advantages_lib.grpo_advantages(
      rollout.scores, trainer.online.samples_per_prompt,
      scale_by_std=trainer.config.grpo.scale_by_std), state.algorithm_state,
          {})


ALGORITHM = base.Algorithm(
    name="grpo",
    summary="Group-relative policy optimisation: group-normalised "
    "advantages, a k3 KL term in the loss, asymmetric clipping and the loss "
    "reductions of DAPO and Dr. GRPO.",
    data=base.PROMPTS,
    networks=recipe.POLICY_REFERENCE_AND_REWARD,
    training=recipe.Online(
        samples_per_prompt=4, num_epochs=1,
        targets=critic_free.make_targets(advantages),
        loss=critic_free.make_loss(clipping),
        loss_count=critic_free.make_loss_count(clipping),
        dynamic_sampling=sampling_rounds),
    # GRPO's carried KL coefficient is its loss's.
    carried=kl_control.carried("grpo.kl_coef"),
    evaluation=reward_model_eval.EVALUATION,
    config_groups=(options.ONLINE, reward_sources.GROUP, teacher.GROUP, GROUP),
    checks=(options.check_online, options.check_groups_of_two),
    pipeline_stage=True,
)
