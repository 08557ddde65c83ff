"""DPO and its family (cDPO, robust DPO, IPO, SLiC, DPO+NLL) on preference
pairs; the loss is jaxrlhf.losses.preference.direct_preference_loss. The
reference log-probs come from a frozen reference in the step, or precomputed
once over the data (config.reference_logprobs; jaxrlhf.recipes.policy)."""

from jaxrlhf.losses import preference
from jaxrlhf.recipes import policy


class DirectPreferenceRecipe(policy.PolicyRecipe):
  data_kind = "pairs"
  supports_precomputed_reference = True

  def loss(self, params, frozen, batch, rng):
    cfg = self.config.dpo
    names = ("chosen", "rejected")
    pi = self.sequence_logprobs(params["policy"], batch, names)
    ref = self.reference_logprobs(frozen, batch, names)
    lengths = self.completion_lengths(batch, names)
    return preference.direct_preference_loss(
        pi["chosen"], pi["rejected"], ref["chosen"], ref["rejected"],
        loss_type=cfg.loss_type, beta=cfg.beta,
        label_smoothing=cfg.label_smoothing, slic_delta=cfg.slic_delta,
        length_normalize=cfg.length_normalize,
        chosen_lengths=lengths["chosen"], rejected_lengths=lengths["rejected"],
        nll_coef=cfg.nll_coef)
