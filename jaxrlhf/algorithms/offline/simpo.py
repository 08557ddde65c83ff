"""SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a
Reference-Free Reward", section 2) on preference pairs.

The implicit reward is the policy's length-normalised log-likelihood,
r(x, y) = beta / |y| log pi(y|x), and the loss asks the chosen completion to
win by a target margin gamma:

  loss = -log sigmoid(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x)
                      - gamma),

the reference-free, length-normalised member of
`jaxrlhf.losses.preference.direct_preference_loss` (TRL's CPOTrainer with
loss_type "simpo" and cpo_alpha 0: its simpo_gamma is gamma). |y| counts the
completion's tokens with its EOS. No reference network is built or run;
evaluation compares the policy with the one it started from, loaded while it
runs (`reference.POLICY_ONLY`).
"""

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.offline import training
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.algorithms import reference
from jaxrlhf.data import alignment_kinds
from jaxrlhf.losses import preference
from jaxrlhf.models import scoring

F = config_schema.Field

GROUP = config_schema.Group(
    "simpo", "SimPO on pairs (algorithm simpo).", [
        F("beta", 2.0, "beta of the reward beta * (mean token log pi(y|x)) "
          "(the SimPO paper tunes 2.0 to 2.5).", bounds=">0"),
        F("gamma", 1.0, "gamma, the target reward margin: the loss is -log "
          "sigmoid(beta * (normalised log-likelihood gap) - gamma) (TRL's "
          "simpo_gamma; the paper's gamma / beta of 0.5 at beta 2).",
          bounds=">=0"),
    ])


PAIR = alignment_kinds.PAIRS.completion_fields


def loss(trainer, params, state, batch, rng):
  del state, rng
  cfg = trainer.config.simpo
  pi = scoring.sequence_logprobs(trainer.lm, params["policy"], batch, PAIR)
  lengths = scoring.completion_lengths(trainer.lm, batch, PAIR)
  return preference.direct_preference_loss(
      pi["chosen"], pi["rejected"], None, None, loss_type="dpo",
      beta=cfg.beta, target_margin=cfg.gamma, length_normalize=True,
      reference_free=True, chosen_lengths=lengths["chosen"],
      rejected_lengths=lengths["rejected"],
      weights=scoring.example_weights(batch))


ALGORITHM = base.Algorithm(
    name="simpo",
    summary="SimPO on pairs: reference-free rewards (beta times the mean "
    "token log-likelihood) with a target margin gamma.",
    data="pairs",
    networks=reference.POLICY_ONLY,
    training=training.Offline(loss=loss, packs=True),
    evaluation=policy_eval.AGAINST_REFERENCE,
    config_groups=(GROUP,),
    pipeline_stage=True,
)
