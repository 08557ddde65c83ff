"""DRO-V (Richemond et al. 2024, section 3.3 and Algorithm 1).

Single trajectories (x, y, r). Two networks by default: the policy, and a
value network that sees only the prompt (for T5, the encoder's mean-pooled
output through a scalar head), each with its own optimizer and learning rate
(`config.dro.value_learning_rate`). `config.dro.shared_network` instead puts
the value head on the policy's own encoder. The losses are
jaxrlhf.losses.dro.dro_v_losses: the policy receives equation 8 rescaled by
1/tau and the value equation 7. The reference log-probs log pi_ref(y|x) of
equation 4 may be precomputed once over the data (config.reference_logprobs;
jaxrlhf.recipes.policy).
"""

import copy

import jax

from jaxrlhf.losses import dro as dro_losses
from jaxrlhf.models import heads
from jaxrlhf.recipes import policy


class DROVRecipe(policy.PolicyRecipe):
  data_kind = "trajectory"
  supports_precomputed_reference = True

  def init_trainable(self, rng):
    a, b, c = jax.random.split(rng, 3)
    out = {"policy": self.init_lm(a)}
    emb = self.model_config.emb_dim
    if self.config.dro.shared_network:
      out["value"] = {"head": heads.init_scalar_head(c, emb)}
    else:
      out["value"] = heads.init_from_backbone(c, self.init_lm(b), emb)
    return out

  def pretrained_paths(self):
    paths = super().pretrained_paths()
    if not self.config.dro.shared_network and self.config.dro.value_from_policy:
      # The paper initialises the value network from the SFT checkpoint too.
      paths["params/value/backbone"] = self.config.init.policy_checkpoint
    return paths

  def optimizer_configs(self):
    value = copy.deepcopy(self.config.optimizer)
    value.learning_rate = self.config.dro.value_learning_rate
    return {"policy": self.config.optimizer, "value": value}

  def values(self, params, batch):
    value_params = params["value"]
    if self.config.dro.shared_network:
      value_params = {"backbone": params["policy"], "head": value_params["head"]}
    return heads.prompt_values(self.lm, value_params, batch)

  def loss(self, params, frozen, batch, rng):
    cfg = self.config.dro
    pi = self.sequence_logprobs(params["policy"], batch, ("completion",))
    ref = self.reference_logprobs(frozen, batch, ("completion",))
    policy_loss, value_loss, metrics = dro_losses.dro_v_losses(
        pi["completion"], ref["completion"], self.values(params, batch),
        batch["reward"], tau=cfg.tau,
        single_value_per_batch=cfg.single_value_per_batch)
    metrics = dict(metrics, policy_loss=policy_loss, value_loss=value_loss)
    return policy_loss + value_loss, metrics
