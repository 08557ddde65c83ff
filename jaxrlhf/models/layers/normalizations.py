"""Normalisation layers, statistics in float32: `RMSNorm` (Llama and its
derivatives) and `LayerNorm` (GPT-NeoX)."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


class RMSNorm(nn.Module):
  """x / sqrt(mean(x^2) + eps) * scale over the last axis, in float32.

  Matches Hugging Face's LlamaRMSNorm: statistics in float32, the normalised
  value cast to the compute dtype, then multiplied by the scale. `axis_name`
  is the scale's logical axis ("kv" for a norm over each head's channels).
  """
  epsilon: float = 1e-6
  dtype: Any = jnp.float32
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x [..., features] -> [..., features] in `dtype`."""
    scale = self.param(
        "scale", nn.with_logical_partitioning(nn.initializers.ones,
                                              (self.axis_name,)),
        (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(
        jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return normed.astype(self.dtype) * scale.astype(self.dtype)


class LayerNorm(nn.Module):
  """Mean/variance LayerNorm with scale and bias, statistics in float32."""
  epsilon: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x [..., embed] -> [..., embed] in `dtype`."""
    features = x.shape[-1]
    scale = self.param(
        "scale", nn.with_logical_partitioning(nn.initializers.ones,
                                              ("embed",)),
        (features,), jnp.float32)
    bias = self.param(
        "bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                             ("embed",)),
        (features,), jnp.float32)
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
    return (normed * scale + bias).astype(self.dtype)
