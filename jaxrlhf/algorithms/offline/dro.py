"""DRO-V (Richemond et al. 2024, section 3.3 and Algorithm 1).

Single trajectories (x, y, r). The losses are
jaxrlhf.losses.dro_losses.dro_v_losses: the policy receives equation 8 and
the value equation 7. The policy's update
is multiplied by 1/tau after its optimizer (`update_scales`), the paper's
"policy learning rate rescaling" (end of section 3.3). The reference
log-probs log pi_ref(y|x) of equation 4 may be precomputed once over the
data (`reference_logprobs`, jaxrlhf.algorithms.reference).

Where V(x) comes from (`dro.value_source`, section 3.3 "Neural network
implementation" and Figure 5's parameter-sharing ablation):

  value_network  DRO-V as published: a second network that sees only the
                 prompt (for T5, the encoder's mean-pooled output through a
                 scalar head), with its own optimizer and learning rate
                 (`dro.value_learning_rate`), its backbone initialised from
                 the SFT checkpoint.
  policy_logits  the paper's single-network ablation, "using policy logits
                 as value outputs": V(x) is one output logit of the policy
                 itself, that of token `dro.value_token_id` at the
                 completion's first step (the step that has read only the
                 prompt). There are no value parameters: equation 7 trains
                 the policy's own weights through that logit.
  policy_head    another single network, not the paper's: a scalar head on
                 the policy's own prompt states (its T5 encoder), trained
                 with `dro.value_learning_rate` while equation 7 also
                 reaches the shared encoder.
"""

import copy

import jax
import jax.numpy as jnp

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.offline import training
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.algorithms import reference
from jaxrlhf.algorithms.offline import sft
from jaxrlhf.losses import dro_losses as dro_losses
from jaxrlhf.models import heads
from jaxrlhf.models import scoring

F = config_schema.Field

VALUE_NETWORK, POLICY_LOGITS, POLICY_HEAD = (
    "value_network", "policy_logits", "policy_head")
VALUE_SOURCES = (VALUE_NETWORK, POLICY_LOGITS, POLICY_HEAD)

GROUP = config_schema.Group(
    "dro", "DRO-V (algorithm dro_v).", [
        F("tau", 1.0, "KL regularisation strength tau (DRO paper default "
          "1.0). The policy's update is multiplied by 1/tau after its "
          "optimizer (the paper's policy learning-rate rescaling, section "
          "3.3), for every optimizer.", bounds=">0"),
        F("value_source", VALUE_NETWORK,
          "Where V(x) comes from: 'value_network' (DRO-V: a separate network "
          "on the prompt), 'policy_logits' (the paper's single-network "
          "ablation, Figure 5: V(x) is the policy's logit of "
          "dro.value_token_id at the completion's first step; no value "
          "parameters), 'policy_head' (not the paper's: a scalar head on the "
          "policy's own prompt states).", choices=VALUE_SOURCES),
        F("value_token_id", 0,
          "policy_logits: the token whose first-step logit is V(x); the "
          "default 0 is PAD in T5's and the synthetic vocabularies, a token "
          "no completion contains.",
          bounds=">=0"),
        F("value_learning_rate", 1e-4,
          "Learning rate of the value parameters' optimizer (same kind and "
          "schedule as config.optimizer, which drives the policy): the value "
          "network, or the policy_head's head; unused by policy_logits.",
          bounds=">0"),
        F("single_value_per_batch", False,
          "One value per batch instead of per prompt (the paper's Figure 5 "
          "ablation)."),
        F("value_from_policy", True,
          "value_network: start its backbone from init.policy_checkpoint."),
    ])


def networks(trainer, rng):
  a, b, c = jax.random.split(rng, 3)
  out = {"policy": trainer.init_lm(a)}
  emb = trainer.model_config.emb_dim
  source = trainer.config.dro.value_source
  token = trainer.config.dro.value_token_id
  vocab = trainer.model_config.vocab_size
  if source == POLICY_LOGITS and token >= vocab:
    raise ValueError(
        f"config.dro.value_token_id: {token} is not a token of the policy's "
        f"{vocab}-entry output; use an id below it (0 is PAD).")
  if source == VALUE_NETWORK:
    out["value"] = heads.init_from_backbone(c, trainer.init_lm(b), emb)
  elif source == POLICY_HEAD:
    out["value"] = {"head": heads.init_scalar_head(c, emb)}
  return out


def checkpoints(trainer):
  paths = reference.policy_and_reference_checkpoints(trainer)
  cfg = trainer.config.dro
  if cfg.value_source == VALUE_NETWORK and cfg.value_from_policy:
    # The paper initialises the value network from the SFT checkpoint too.
    paths["params/value/backbone"] = trainer.config.init.policy_checkpoint
  return paths


def fresh_backbone(config) -> str:
  """How the value network would start from the policy's checkpoint, when
  it starts fresh (`Networks.fresh_backbone`)."""
  cfg = config.dro
  if cfg.value_source == VALUE_NETWORK and not cfg.value_from_policy:
    return ("with dro.value_from_policy=False the value network's backbone "
            "starts fresh: set dro.value_from_policy=True (the paper's)")
  return ""


def optimizers(config):
  if config.dro.value_source == POLICY_LOGITS:
    return {"policy": config.optimizer}
  value = copy.deepcopy(config.optimizer)
  value.learning_rate = config.dro.value_learning_rate
  return {"policy": config.optimizer, "value": value}


def update_scales(config):
  # Section 3.3, "Policy learning rate rescaling": "we rescale the policy
  # gradient Equation (8) by multiplying the update by a factor of 1/tau".
  # After the optimizer, because Adafactor and Adam are invariant to the
  # gradient's scale: a loss times 1/tau would move them no further. The
  # value's update is not rescaled; in the single-network variants the
  # shared weights are the policy's and their whole update is.
  return {"policy": 1.0 / config.dro.tau}


def completion_view(lm, batch):
  """The batch's `completion_*` features under the unprefixed names of SFT
  batches (with the prompt features, and a packed batch's segment ids and
  example mask), for `sft.next_token_targets`."""
  completion_segments, prompt_segments = lm.segment_keys(None)
  keys = list(lm.completion_keys(None))
  if f"completion_{completion_segments[0]}" in batch:
    keys += completion_segments
  view = {key: batch[f"completion_{key}"] for key in keys}
  view.update({key: batch[key] for key in tuple(lm.prompt_keys)
               + tuple(prompt_segments) + (scoring.EXAMPLE_MASK,)
               if key in batch})
  return view


def logprobs_and_logit_values(lm, value_token_id: int, params, batch):
  """([batch] log pi(y|x), [batch] V(x)) from one forward pass of the policy
  ([rows * k] each for a packed batch, one per slot).

  V(x) is the logit of `dro.value_token_id` where the policy predicts the
  completion's first token, a step that has read only the prompt (the
  decoder's first step for T5, the last prompt token for decoder-only).
  """
  view = completion_view(lm, batch)
  logits, targets, weights = sft.next_token_targets(lm, params, view)
  weights = weights.astype(jnp.float32)
  token = value_token_id
  token_logprobs = scoring.token_logprobs(logits, targets) * weights
  k = scoring.examples_per_row(batch)
  if k is None:
    first = jnp.argmax(weights > 0, axis=-1)
    first_logits = jnp.take_along_axis(logits, first[:, None, None], axis=1)
    return (jnp.sum(token_logprobs, axis=-1),
            first_logits[:, 0, token].astype(jnp.float32))
  ids = sft.target_segment_ids(lm, view)
  logprobs = scoring.per_example_sums(token_logprobs, ids, k)
  # Each slot's first weighted target: [rows, k] indices along length.
  in_slot = ((weights > 0)[:, :, None]
             & (ids[:, :, None] == jnp.arange(1, k + 1)[None, None]))
  first = jnp.argmax(in_slot, axis=1)
  token_logits = logits[..., token].astype(jnp.float32)
  return logprobs, jnp.take_along_axis(token_logits, first, axis=1).reshape(-1)


def values(lm, value_source: str, params, batch):
  """[batch] V(x) of each example's prompt, from a value head (the value
  network's, or one on the policy's prompt states); [rows * k] packed."""
  value_params = params["value"]
  if value_source == POLICY_HEAD:
    value_params = {"backbone": params["policy"],
                    "head": value_params["head"]}
  if not scoring.is_packed(batch):
    return heads.prompt_values(lm, value_params, batch)
  return heads.apply_scalar_head(
      value_params["head"],
      scoring.prompt_states(lm, value_params["backbone"], batch,
                            "completion"))


def loss(trainer, params, state, batch, rng):
  del rng
  cfg = trainer.config.dro
  if cfg.value_source == POLICY_LOGITS:
    policy_logps, value = logprobs_and_logit_values(
        trainer.lm, cfg.value_token_id, params["policy"], batch)
  else:
    policy_logps = scoring.sequence_logprobs(
        trainer.lm, params["policy"], batch, ("completion",))["completion"]
    value = values(trainer.lm, cfg.value_source, params, batch)
  ref = reference.reference_logprobs(
      trainer.lm, trainer.precomputed_reference, state, batch, ("completion",))
  policy_loss, value_loss, metrics = dro_losses.dro_v_losses(
      policy_logps, ref["completion"], value,
      scoring.example_values(batch, "reward"), tau=cfg.tau,
      single_value_per_batch=cfg.single_value_per_batch,
      weights=scoring.example_weights(batch))
  metrics = dict(metrics, policy_loss=policy_loss, value_loss=value_loss)
  return policy_loss + value_loss, metrics


ALGORITHM = base.Algorithm(
    name="dro_v",
    summary="Direct Reward Optimisation with a learned value (DRO-V) on "
    "single trajectories (prompt, completion, reward).",
    data="trajectory",
    networks=base.Networks(trainable=networks, frozen=reference.reference,
                           checkpoints=checkpoints, optimizers=optimizers,
                           update_scales=update_scales, reference=True,
                           fresh_backbone=fresh_backbone),
    training=training.Offline(
        loss=loss, precomputable_reference=True, packs=True,
        batch_statistics=lambda c: ("its value (one per batch: "
                                    "dro.single_value_per_batch)"
                                    if c.dro.single_value_per_batch
                                    else None)),
    evaluation=policy_eval.AGAINST_REFERENCE,
    config_groups=(GROUP, reference.REFERENCE_LOGPROBS),
    pipeline_stage=True,
)
