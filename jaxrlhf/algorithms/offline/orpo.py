"""ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
Reference Model") on preference pairs: the chosen completion's token NLL
plus lambda times an odds-ratio term on the length-normalised likelihoods
(`jaxrlhf.losses.orpo_losses`). No reference network is built or run; evaluation
compares the policy with the one it started from, loaded while it runs
(`reference.POLICY_ONLY`).
"""

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.offline import training
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.algorithms import reference
from jaxrlhf.data import alignment_kinds
from jaxrlhf.losses import orpo_losses
from jaxrlhf.models import scoring

F = config_schema.Field

GROUP = config_schema.Group(
    "orpo", "ORPO on pairs (algorithm orpo).", [
        F("odds_ratio_weight", 0.1,
          "lambda, the weight of the odds-ratio term beside the chosen "
          "completions' NLL (TRL's beta; 0 is SFT on the chosen).",
          bounds=">=0"),
    ])


PAIR = alignment_kinds.PAIRS.completion_fields


def loss(trainer, params, state, batch, rng):
  del state, rng
  pi = scoring.sequence_logprobs(trainer.lm, params["policy"], batch, PAIR)
  lengths = scoring.completion_lengths(trainer.lm, batch, PAIR)
  return orpo_losses.orpo_loss(
      pi["chosen"], pi["rejected"], lengths["chosen"], lengths["rejected"],
      odds_ratio_weight=trainer.config.orpo.odds_ratio_weight,
      weights=scoring.example_weights(batch))


ALGORITHM = base.Algorithm(
    name="orpo",
    summary="ORPO on pairs: the chosen completions' NLL plus an odds-ratio "
    "term, without a reference model.",
    data="pairs",
    networks=reference.POLICY_ONLY,
    training=training.Offline(loss=loss, packs=True),
    evaluation=policy_eval.AGAINST_REFERENCE,
    config_groups=(GROUP,),
    pipeline_stage=True,
)
