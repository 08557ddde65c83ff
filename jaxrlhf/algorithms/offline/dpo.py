"""DPO and its family (cDPO, robust DPO, IPO, SLiC, DPO+NLL) on preference
pairs; the loss is jaxrlhf.losses.preference.direct_preference_loss. The
reference log-probs come from a frozen reference in the step, or are
precomputed once over the data (`reference_logprobs`,
jaxrlhf.algorithms.reference)."""

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
    "dpo", "The direct preference losses on pairs (algorithm dpo).", [
        F("loss_type", "dpo",
          "'dpo' (logistic), 'cdpo' (label smoothing), 'robust_dpo', 'ipo', "
          "'slic'.", choices=preference.PAIRWISE_LOSS_TYPES),
        F("beta", 0.1, "beta of f(beta * delta log-ratio); IPO's tau plays "
          "this role.", bounds=">0"),
        F("label_smoothing", 0.0,
          "cdpo / robust_dpo: the assumed label flip rate.",
          bounds="[0, 0.5]"),
        F("slic_delta", 1.0,
          "slic: the hinge margin delta in max(0, delta - beta * delta "
          "log-ratio).", bounds=">=0"),
        F("length_normalize", False,
          "Divide sequence log-probs by completion length (length-normalised "
          "DPO)."),
        F("nll_coef", 0.0,
          "Weight of the chosen completions' mean token NLL (DPO+NLL).",
          bounds=">=0"),
    ])

PAIR = alignment_kinds.PAIRS.completion_fields  # ("chosen", "rejected")


def loss(trainer, params, state, batch, rng):
  del rng
  cfg = trainer.config.dpo
  pi = scoring.sequence_logprobs(trainer.lm, params["policy"], batch, PAIR)
  ref = reference.reference_logprobs(
      trainer.lm, trainer.precomputed_reference, state, batch, PAIR)
  lengths = scoring.completion_lengths(trainer.lm, batch, PAIR)
  return preference.direct_preference_loss(
      pi["chosen"], pi["rejected"], ref["chosen"], ref["rejected"],
      loss_type=cfg.loss_type, beta=cfg.beta,
      label_smoothing=cfg.label_smoothing, slic_delta=cfg.slic_delta,
      length_normalize=cfg.length_normalize,
      chosen_lengths=lengths["chosen"], rejected_lengths=lengths["rejected"],
      nll_coef=cfg.nll_coef, weights=scoring.example_weights(batch))


ALGORITHM = base.Algorithm(
    name="dpo",
    summary="The direct preference family on pairs: DPO, cDPO, robust DPO, "
    "IPO, SLiC, with length normalisation and an NLL term (dpo.loss_type).",
    data="pairs",
    networks=reference.POLICY_AND_REFERENCE,
    training=training.Offline(loss=loss, precomputable_reference=True,
                             packs=True),
    evaluation=policy_eval.AGAINST_REFERENCE,
    config_groups=(GROUP, reference.REFERENCE_LOGPROBS),
    pipeline_stage=True,
)
