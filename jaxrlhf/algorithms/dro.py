"""DRO-V (Richemond et al. 2024, section 3.3 and Algorithm 1).

Single trajectories (x, y, r). Two networks by default: the policy, and a
value network that sees only the prompt (for T5, the encoder's mean-pooled
output through a scalar head), each with its own optimizer and learning rate
(`dro.value_learning_rate`). `dro.shared_network` instead puts the value head
on the policy's own encoder. The losses are jaxrlhf.losses.dro.dro_v_losses:
the policy receives equation 8 rescaled by 1/tau and the value equation 7.
The reference log-probs log pi_ref(y|x) of equation 4 may be precomputed once
over the data (`reference_logprobs`, jaxrlhf.algorithms.reference).
"""

import copy

import jax

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import reference
from jaxrlhf.losses import dro as dro_losses
from jaxrlhf.models import heads

F = config_schema.Field

GROUP = config_schema.Group(
    "dro", "DRO-V (algorithm dro_v).", [
        F("tau", 1.0, "KL regularisation strength tau (DRO paper default "
          "1.0).", bounds=">0"),
        F("value_learning_rate", 1e-4,
          "Learning rate of the value network's optimizer (same kind and "
          "schedule as config.optimizer, which drives the policy).",
          bounds=">0"),
        F("shared_network", False,
          "One shared network: the value head reads the policy's own "
          "encoder."),
        F("single_value_per_batch", False,
          "One value per batch instead of per prompt (the paper's Figure 5 "
          "ablation)."),
        F("value_from_policy", True,
          "Start the separate value network's backbone from "
          "init.policy_checkpoint."),
    ])


def networks(trainer, rng):
  a, b, c = jax.random.split(rng, 3)
  out = {"policy": trainer.init_lm(a)}
  emb = trainer.model_config.emb_dim
  if trainer.config.dro.shared_network:
    out["value"] = {"head": heads.init_scalar_head(c, emb)}
  else:
    out["value"] = heads.init_from_backbone(c, trainer.init_lm(b), emb)
  return out


def checkpoints(trainer):
  paths = reference.policy_and_reference_checkpoints(trainer)
  cfg = trainer.config.dro
  if not cfg.shared_network and cfg.value_from_policy:
    # The paper initialises the value network from the SFT checkpoint too.
    paths["params/value/backbone"] = trainer.config.init.policy_checkpoint
  return paths


def optimizers(trainer):
  value = copy.deepcopy(trainer.config.optimizer)
  value.learning_rate = trainer.config.dro.value_learning_rate
  return {"policy": trainer.config.optimizer, "value": value}


def values(trainer, params, batch):
  """[batch] V(x) of each example's prompt."""
  value_params = params["value"]
  if trainer.config.dro.shared_network:
    value_params = {"backbone": params["policy"],
                    "head": value_params["head"]}
  return heads.prompt_values(trainer.lm, value_params, batch)


def loss(trainer, params, frozen, batch, rng):
  del rng
  cfg = trainer.config.dro
  pi = reference.sequence_logprobs(trainer, params["policy"], batch,
                                   ("completion",))
  ref = reference.reference_logprobs(trainer, frozen, batch, ("completion",))
  policy_loss, value_loss, metrics = dro_losses.dro_v_losses(
      pi["completion"], ref["completion"], values(trainer, params, batch),
      batch["reward"], tau=cfg.tau,
      single_value_per_batch=cfg.single_value_per_batch)
  metrics = dict(metrics, policy_loss=policy_loss, value_loss=value_loss)
  return policy_loss + value_loss, metrics


ALGORITHM = base.Algorithm(
    name="dro_v",
    summary="Direct Reward Optimisation with a learned value (DRO-V) on "
    "single trajectories (prompt, completion, reward).",
    data="trajectory",
    networks=base.Networks(trainable=networks, frozen=reference.reference,
                           checkpoints=checkpoints, optimizers=optimizers,
                           reference=True),
    training=base.Offline(loss=loss, precomputable_reference=True),
    evaluation=reference.AGAINST_REFERENCE,
    config_groups=(GROUP, reference.REFERENCE_LOGPROBS),
)
