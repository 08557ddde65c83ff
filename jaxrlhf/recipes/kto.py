"""KTO (Ethayarajh et al. 2024) on single trajectories or thumbs.

With trajectories, as in the DRO paper's KTO baseline, a completion is
desirable when its reward is above the batch mean. The KL baseline z0 uses
mismatched pairs: prompt i with the completion of example i+1.
"""


from jaxrlhf.losses import preference
from jaxrlhf.recipes import policy

_COMPLETION_SUFFIXES = ("decoder_target_tokens", "decoder_input_tokens",
                        "decoder_loss_weights")


def with_mismatched_completions(batch):
  """Adds `mismatched_*` features: example i's prompt, example i+1's
  completion (`preference.kto_mismatched_indices`)."""
  index = preference.kto_mismatched_indices(
      batch["encoder_input_tokens"].shape[0])
  out = dict(batch)
  for suffix in _COMPLETION_SUFFIXES:
    out[f"mismatched_{suffix}"] = batch[f"completion_{suffix}"][index]
  return out


class KTORecipe(policy.PolicyRecipe):
  data_kind = "trajectory"

  def __init__(self, config, mesh):
    super().__init__(config, mesh)
    if not self.lm.is_encoder_decoder:
      raise ValueError(
          f"config.model.arch: {config.model.arch!r}: KTO's KL baseline pairs "
          "prompt i with completion i+1, which is built for encoder-decoder "
          "batches only so far; use a T5 policy.")

  def loss(self, params, frozen, batch, rng):
    cfg = self.config.kto
    batch = with_mismatched_completions(batch)
    names = ("completion", "mismatched")
    pi = self.sequence_logprobs(params["policy"], batch, names)
    ref = self.reference_logprobs(frozen, batch, names)
    if "label" in batch:
      desirable = batch["label"] > 0.5
    else:
      desirable = preference.desirable_from_rewards(batch["reward"])
    return preference.kto_loss(
        pi["completion"], ref["completion"], desirable,
        pi["mismatched"], ref["mismatched"], beta=cfg.beta,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight)


class KTOThumbsRecipe(KTORecipe):
  data_kind = "thumbs"
