"""TR-DPO (Gorbatovski et al. 2024, "Learn Your Reference Model for Real
Good Alignment"): DPO whose reference follows the policy.

Every `tr_dpo.sync_steps` train steps the reference becomes a mix of the
policy and itself,

  pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref

parameter by parameter, after that step's update: alpha = 1 every tau steps
is the paper's hard update (TR-DPO^tau), a small tau with alpha < 1 its
soft update (TR-DPO^alpha); the parametrisation and defaults are TRL's
(`DPOConfig.sync_ref_model`, `ref_model_mixup_alpha` 0.6,
`ref_model_sync_steps` 512: the reference is mixed after each step whose
count is a multiple of them). The loss is `dpo`'s, with its `dpo.*` fields.
The moving reference is part of the checkpointed train state; evaluation
compares the policy with the one the run started from, loaded afresh.
"""

import jax

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.offline import dpo
from jaxrlhf.algorithms.offline import training
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.algorithms import reference

F = config_schema.Field

GROUP = config_schema.Group(
    "tr_dpo", "TR-DPO: DPO with a reference that follows the policy "
    "(algorithm tr_dpo; its loss is set by the dpo group).", [
        F("mixup_alpha", 0.6,
          "alpha of pi_ref <- alpha * pi + (1 - alpha) * pi_ref (TRL's "
          "ref_model_mixup_alpha; 1 = the paper's hard update).",
          bounds="(0, 1]"),
        F("sync_steps", 512,
          "Mix the policy into the reference after every this many train "
          "steps (TRL's ref_model_sync_steps, the paper's tau).",
          bounds=">0"),
    ])


def mix_reference(trainer, before, after, metrics):
  """The reference after this step: mixed with the updated policy when the
  step count is a multiple of `sync_steps`."""
  del before, metrics
  cfg = trainer.config.tr_dpo
  alpha = cfg.mixup_alpha

  def mixed(frozen):
    ref = jax.tree.map(lambda p, r: (alpha * p + (1 - alpha) * r).astype(
        r.dtype), after.params["policy"], frozen["reference"])
    return dict(frozen, reference=ref)

  frozen = jax.lax.cond(after.step % cfg.sync_steps == 0, mixed,
                        lambda frozen: frozen, after.frozen)
  return after.replace(frozen=frozen)


ALGORITHM = base.Algorithm(
    name="tr_dpo",
    summary="TR-DPO: DPO (dpo.loss_type and the rest) with a reference that "
    "is mixed with the policy every tr_dpo.sync_steps steps.",
    data="pairs",
    networks=reference.POLICY_AND_REFERENCE,
    training=training.Offline(loss=dpo.loss, carry=mix_reference),
    carried=base.Carried(changes_frozen=("reference",)),
    evaluation=policy_eval.AGAINST_REFERENCE,
    config_groups=(dpo.GROUP, GROUP),
)
