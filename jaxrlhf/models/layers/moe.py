"""A dropless mixture-of-experts MLP (`MoeMlp`), its router's
load-balancing loss (`load_balancing_loss`) and per-expert load
(`expert_load`).

Each token's router picks its top-k experts; every (token, expert) copy is
computed: no capacity factor, nothing dropped. The copies are sorted by
expert so that each expert's rows are contiguous, and the three SwiGLU
projections are grouped matrix products (`jax.lax.ragged_dot`) with the
experts' row counts as group sizes.
"""

from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models.layers import linears

Array = jax.Array


def route(router_logits: Array, top_k: int,
          norm_topk_prob: bool) -> Tuple[Array, Array]:
  """Top-k routing of router_logits [tokens, experts].

  Returns (weights float32 [tokens, top_k], experts int32 [tokens, top_k]):
  the softmax probabilities (over all experts, in float32) of each token's
  k most probable experts, renormalised to sum to 1 when `norm_topk_prob`.
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts.astype(jnp.int32)


class MoeMlp(nn.Module):
  """Router linear, softmax over experts, top-k, then the chosen experts'
  gated SwiGLU MLPs (silu(x wi_0) * (x wi_1)) wo, summed with the routing
  weights.

  Parameters: `router/kernel` [embed, expert]; `wi_0`, `wi_1`
  [expert, embed, mlp] and `wo` [expert, mlp, embed], float32, cast to
  `dtype` at every read (as `linears.DenseGeneral`).
  """
  num_experts: int
  top_k: int
  mlp_dim: int
  norm_topk_prob: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Tuple[Array, Array]:
    """x [batch, length, embed] -> (y [batch, length, embed] in `dtype`,
    router_logits float32 [batch, length, experts])."""
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"MoeMlp: top_k={self.top_k} must be in "
                       f"[1, num_experts={self.num_experts}]")
    batch, length, embed = x.shape
    e, k, mlp = self.num_experts, self.top_k, self.mlp_dim
    router_logits = linears.DenseGeneral(
        (e,), ("embed", "expert"), dtype=self.dtype, name="router")(x)
    router_logits = router_logits.astype(jnp.float32)
    init_in = linears.kernel_init(1, 1)

    def expert_kernel(name, shape, axes):
      # Fan-in over the one input axis of each expert's own matrix.
      def init(key, shape, dtype):
        keys = jax.random.split(key, shape[0])
        return jax.vmap(lambda kk: init_in(kk, shape[1:], dtype))(keys)
      return self.param(name, nn.with_logical_partitioning(init, axes),
                        shape, jnp.float32).astype(self.dtype)

    wi_0 = expert_kernel("wi_0", (e, embed, mlp), ("expert", "embed", "mlp"))
    wi_1 = expert_kernel("wi_1", (e, embed, mlp), ("expert", "embed", "mlp"))
    wo = expert_kernel("wo", (e, mlp, embed), ("expert", "mlp", "embed"))

    tokens = x.reshape(batch * length, embed).astype(self.dtype)
    weights, experts = route(router_logits.reshape(-1, e), k,
                             self.norm_topk_prob)
    flat_experts = experts.reshape(-1)                   # [tokens * k]
    # Stable sort: each expert's copies contiguous, in token order.
    order = jnp.argsort(flat_experts, stable=True)
    rows = tokens[order // k]                            # [tokens * k, embed]
    group_sizes = jnp.bincount(flat_experts, length=e).astype(jnp.int32)
    gate = jax.lax.ragged_dot(rows, wi_0, group_sizes)
    up = jax.lax.ragged_dot(rows, wi_1, group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, wo, group_sizes)
    unsorted = jnp.zeros_like(out).at[order].set(out)    # copy order again
    y = jnp.sum(unsorted.reshape(-1, k, embed)
                * weights[..., None].astype(self.dtype), axis=1)
    return (y.reshape(batch, length, embed),
            router_logits.reshape(batch, length, e))


def _token_mask(router_logits: Array, mask: Optional[Array]) -> Array:
  """float32 [tokens] of ones, or `mask` flattened (1 counts, 0 ignored)."""
  n = router_logits.reshape(-1, router_logits.shape[-1]).shape[0]
  if mask is None:
    return jnp.ones((n,), jnp.float32)
  if mask.size != n:
    raise ValueError(f"load_balancing_loss: mask has {mask.size} entries "
                     f"but router_logits has {n} tokens; give one mask "
                     "entry per token (tile it over layers)")
  return mask.reshape(-1).astype(jnp.float32)


def expert_load(router_logits: Array, top_k: int,
                mask: Optional[Array] = None) -> Array:
  """float32 [experts]: the share of the counted tokens' routed slots
  (top_k per token) that each expert received; sums to 1.

  router_logits [..., experts] (any leading axes: layers, batch, length);
  mask: one entry per token of the leading axes, or None (all count).
  """
  e = router_logits.shape[-1]
  m = _token_mask(router_logits, mask)
  _, experts = jax.lax.top_k(router_logits.reshape(-1, e), top_k)
  counts = jnp.sum(jax.nn.one_hot(experts, e) * m[:, None, None], axis=(0, 1))
  return counts / jnp.maximum(top_k * jnp.sum(m), 1.0)


def load_balancing_loss(router_logits: Array, top_k: int, num_experts: int,
                        mask: Optional[Array] = None) -> Array:
  """The router's auxiliary loss as transformers' `load_balancing_loss_func`
  defines it (Switch Transformer's, with top-k):

    num_experts * sum_e f_e * P_e

  f_e: the counted tokens whose top-k includes expert e, over the counted
  tokens (so sum_e f_e = top_k); P_e: the mean softmax probability of e over
  the counted tokens. Equal to top_k when the router is uniform in both.
  Scale it by `router_aux_loss_coef` outside.

  router_logits [..., experts] (layers' logits stacked or concatenated on
  the leading axes, as transformers concatenates them); mask: one entry per
  token of the leading axes (1 counts), or None. Returns float32 [].
  """
  if router_logits.shape[-1] != num_experts:
    raise ValueError(f"load_balancing_loss: router_logits' last axis is "
                     f"{router_logits.shape[-1]}, not num_experts="
                     f"{num_experts}")
  logits = router_logits.reshape(-1, num_experts).astype(jnp.float32)
  m = _token_mask(router_logits, mask)
  total = jnp.maximum(jnp.sum(m), 1.0)
  probs = jax.nn.softmax(logits, axis=-1)
  _, experts = jax.lax.top_k(probs, top_k)
  # [tokens, experts]: 1 where the expert is among the token's top k.
  chosen = jnp.sum(jax.nn.one_hot(experts, num_experts), axis=1)
  f = jnp.sum(chosen * m[:, None], axis=0) / total
  p = jnp.sum(probs * m[:, None], axis=0) / total
  return num_experts * jnp.sum(f * p)
