"""Reward and value models: a language-model backbone plus a scalar head.

The parameters are {"backbone": <the LM's params>, "head": {"kernel", "bias"}},
a tree separate from the policy's, so a reward or value model can start from a
policy checkpoint (`init_from_backbone`) and train on its own.

PPO implementation details (Huang et al. 2024): the head is initialised
N(0, 1/sqrt(d_model + 1)) with bias 0 (detail 11); the reward is read at the
completion's last real token, the EOS (detail 12); `shift_bias` moves
the bias so that SFT reference completions score mean 0 (detail 15; the
reward-model recipe's `reward_model.normalize_on_task`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models import scoring


def init_scalar_head(rng, emb_dim: int):
  """{"kernel" [emb_dim], "bias" []} with logical axis names for sharding."""
  std = 1.0 / jnp.sqrt(emb_dim + 1.0)
  kernel = jax.random.normal(rng, (emb_dim,), jnp.float32) * std
  return {"kernel": nn.LogicallyPartitioned(kernel, ("embed",)),
          "bias": jnp.zeros((), jnp.float32)}


def apply_scalar_head(head, states):
  """[..., emb_dim] states -> [...] float32 scalars."""
  return jnp.dot(states.astype(jnp.float32), head["kernel"]) + head["bias"]


def init_from_backbone(rng, backbone_params, emb_dim: int):
  """Reward/value model params whose backbone is a copy of `backbone_params`."""
  return {"backbone": backbone_params, "head": init_scalar_head(rng, emb_dim)}


def shift_bias(params, shift):
  """Params whose head bias is `shift` (a scalar) higher: every score the
  model gives moves by exactly `shift`, so reward differences stay the same."""
  bias = params["head"]["bias"]
  head = dict(params["head"], bias=bias + jnp.asarray(shift, bias.dtype))
  return dict(params, head=head)


def sequence_rewards(lm, params, batch, name=None, rng=None):
  """One scalar per (prompt, completion): the head at the EOS. [batch]."""
  hidden, mask = lm.completion_hidden(params["backbone"], batch, name, rng)
  return apply_scalar_head(params["head"],
                           scoring.last_token_states(hidden, mask))


def token_values(lm, params, batch, name=None, rng=None):
  """One value per completion position (PPO's value model). [batch, L]."""
  hidden, mask = lm.completion_hidden(params["backbone"], batch, name, rng)
  return apply_scalar_head(params["head"], hidden) * mask


def prompt_values(lm, params, batch, rng=None):
  """One value per prompt, from the prompt alone (DRO-V's V(x)). [batch].

  The head reads the mean of the prompt states: for T5 the encoder output,
  for decoder-only models the prompt's hidden states.
  """
  hidden, mask = lm.prompt_hidden(params["backbone"], batch, rng)
  return apply_scalar_head(params["head"],
                           scoring.masked_mean_states(hidden, mask))
