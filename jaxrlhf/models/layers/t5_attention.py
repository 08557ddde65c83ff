"""T5-style attention: relative-position bias, no scaling, joined heads.

The t5x families (T5 and t5x's decoder-only model) use these: one
bucketed relative-position bias table per stack, added (with the mask, as
-1e10) to unscaled attention logits (1/sqrt(head_dim) is folded into the
query initialisation), and 2-D projection kernels [embed, heads * kv]
(t5x's 'joined_kv' layout).
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models.layers import kv_cache
from jaxrlhf.models.layers import linears
from jaxrlhf.models.layers import param_recording


# Masked attention logits get this additive bias (t5x's value), in the
# activation dtype.
T5_MASK_VALUE = -1e10
# t5x: normal (not truncated) initialisation of attention kernels.
_t5_attention_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


def relative_position_bucket(relative_position, bidirectional, num_buckets,
                             max_distance):
  """T5's bucketing of (memory - query) offsets: exact near, log-spaced far.

  Args:
    relative_position: int array of memory_position - query_position.
  Returns:
    int32 array of the same shape with values in [0, num_buckets).
  """
  bucket = 0
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    bucket += (n < 0).astype(np.int32) * num_buckets
    n = np.abs(n)
  else:
    n = np.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # Offsets beyond max_exact share buckets logarithmically up to max_distance.
  large = max_exact + (
      np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
      / np.log(max_distance / max_exact) * (num_buckets - max_exact)
  ).astype(np.int32)
  large = np.minimum(large, num_buckets - 1)
  return (bucket + np.where(is_small, n, large)).astype(np.int32)


class RelativePositionBias(nn.Module):
  """Per-head additive attention bias from bucketed relative positions."""
  num_heads: int
  num_buckets: int
  max_distance: int
  bidirectional: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, query_length: int, key_length: int, query_offset=None):
    """Returns the bias [1, heads, query_length, key_length].

    Query i sits at position i, or at `query_offset + i` when given (a traced
    int scalar: incremental decoding, where the queries are the newest tokens
    and the keys every cached position 0 .. key_length - 1).
    """
    table = self.param(
        "rel_embedding",
        nn.with_logical_partitioning(
            nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
            ("heads", "relpos_buckets")),
        (self.num_heads, self.num_buckets), jnp.float32)
    if query_offset is None:
      offsets = (np.arange(key_length)[None, :]
                 - np.arange(query_length)[:, None])
      buckets = jnp.asarray(relative_position_bucket(
          offsets, self.bidirectional, self.num_buckets, self.max_distance))
    else:
      # The bucket of every possible offset comes from the same numpy code as
      # the static path (a float32 log computed by XLA could round a boundary
      # offset into the neighbouring bucket), then is gathered by the traced
      # offsets.
      all_offsets = np.arange(-(key_length - 1), key_length)
      bucket_of = jnp.asarray(relative_position_bucket(
          all_offsets, self.bidirectional, self.num_buckets,
          self.max_distance))
      query_positions = query_offset + jnp.arange(query_length)
      offsets = jnp.arange(key_length)[None, :] - query_positions[:, None]
      buckets = jnp.take(bucket_of, offsets + key_length - 1, mode="clip")
    bias = jnp.take(table, buckets, axis=1)
    return bias[None].astype(self.dtype)


def pairwise_mask(query_valid, key_valid, causal=False):
  """[batch, 1, q, k] mask of allowed (query, key) pairs: both valid (and,
  with `causal`, key <= query)."""
  mask = query_valid[:, None, :, None] & key_valid[:, None, None, :]
  if causal:
    q, k = query_valid.shape[-1], key_valid.shape[-1]
    mask = mask & (np.arange(q)[:, None] >= np.arange(k)[None, :])
  return mask


def mask_to_bias(mask, dtype):
  """A boolean mask as t5x's additive bias (0 or -1e10)."""
  return jnp.where(mask, 0.0, T5_MASK_VALUE).astype(dtype)


class T5Attention(nn.Module):
  """Unscaled dot-product attention with t5x's 2-D projection kernels
  (query/key/value [embed, heads * head_dim], out [heads * head_dim,
  embed]).

  KV cache (incremental decoding), in the flax "cache" collection (apply
  with `mutable=["cache"]`):
  - self-attention, `cache_index` given: the keys/values of `inputs_q` are
    written at positions [cache_index, cache_index + q_len) of
    `cached_key`/`cached_value` [batch, heads, T, head_dim] (T = the bias's
    key length; created as zeros on the first call) and the queries attend
    over all T positions, the bias masking the ones not yet written;
  - cross-attention, `cache_cross=True`: with `inputs_kv` the keys/values of
    the encoder output are computed and stored ([batch, heads, enc_len,
    head_dim]); with `inputs_kv=None` the stored ones are read (the encoder
    output is projected once per sample).
  Both caches keep heads before length, so that a decode step reads them in
  place (see `update_kv_cache`).
  """
  num_heads: int
  head_dim: int
  dtype: Any = jnp.float32
  float32_logits: bool = False
  dropout_rate: float = 0.0
  attention_impl: str = "xla"
  # Self-attention (`inputs_kv` is `inputs_q`): its query, key and value
  # weights may be read joined (`fuse_projections`).
  self_attention: bool = False

  @nn.compact
  def __call__(self, inputs_q, inputs_kv, bias, deterministic=True, *,
               cache_index=None, cache_cross=False):
    """inputs [batch, length, embed], bias [batch|1, heads|1, q, k]."""
    features = self.num_heads * self.head_dim
    # 1/sqrt(head_dim) is folded into the query initialisation, not the logits.
    depth_scaling = np.sqrt(self.head_dim).astype(np.float32)
    query_init = lambda *a: _t5_attention_init(*a) / depth_scaling
    project = functools.partial(linears.DenseGeneral, (features,),
                                ("embed", "joined_kv"), dtype=self.dtype,
                                kernel_init=_t5_attention_init)
    batch, q_len = inputs_q.shape[0], inputs_q.shape[1]
    head_axes = ("batch", "length", "heads", "kv")
    joined = None
    fused_name = param_recording.FUSED_T5_QKV.name
    if self.self_attention and self.has_variable("params", fused_name):
      # The three projections joined (`fuse_projections`).
      joined = jnp.split(
          linears.DenseGeneral((3 * features,), ("embed", "joined_kv"),
                               dtype=self.dtype, name=fused_name)(inputs_q),
          3, axis=-1)
      query = joined[0]
    else:
      query = project(kernel_init=query_init, name="query")(inputs_q)
    query = query.reshape(batch, q_len, self.num_heads, self.head_dim)
    query = nn.with_logical_constraint(query, head_axes)
    # Keys and values are [batch, k_len, heads, head_dim], or in the
    # cache's layout [batch, heads, k_len, head_dim] when read from it.
    cache_layout = cache_cross or cache_index is not None
    if cache_cross and inputs_kv is None:
      key = self.get_variable("cache", "cached_key")
      value = self.get_variable("cache", "cached_value")
      if key is None:
        raise ValueError(
            "Cross-attention cache is empty: the first decoding call must "
            "pass the encoder output so its keys and values are cached.")
    else:
      k_len = inputs_kv.shape[1]
      if joined is not None:
        key, value = joined[1:]
      else:
        key = project(name="key")(inputs_kv)
        value = project(name="value")(inputs_kv)
      key = key.reshape(batch, k_len, self.num_heads, self.head_dim)
      value = value.reshape(batch, k_len, self.num_heads, self.head_dim)
      key = nn.with_logical_constraint(key, head_axes)
      value = nn.with_logical_constraint(value, head_axes)
      if cache_cross:
        key, value = (nn.with_logical_constraint(
            jnp.swapaxes(x, 1, 2), ("batch", "heads", "length", "kv"))
                      for x in (key, value))
        for name, new in (("cached_key", key), ("cached_value", value)):
          self.variable("cache", name, lambda x: x, new).value = new
      elif cache_index is not None:
        key = kv_cache.update_kv_cache(self, "cached_key", key, cache_index,
                                       bias.shape[-1], "heads")
        value = kv_cache.update_kv_cache(self, "cached_value", value,
                                         cache_index, bias.shape[-1], "heads")
    use_dropout = not deterministic and self.dropout_rate > 0
    if self.attention_impl == "dot_product" and not (use_dropout
                                                     or cache_layout):
      # jax.nn.dot_product_attention has no attention-weight dropout, nor
      # takes the cache's layout; with dropout active, or decoding, the
      # einsum path below computes the same thing.
      dtype = jnp.float32 if self.float32_logits else query.dtype
      out = jax.nn.dot_product_attention(
          query.astype(dtype), key.astype(dtype), value.astype(dtype),
          bias=bias.astype(dtype), scale=1.0).astype(self.dtype)
    else:
      kv = "bhkd" if cache_layout else "bkhd"
      # Keys and values as chunks (`update_kv_cache`'s; one otherwise).
      keys = key if isinstance(key, tuple) else (key,)
      values = value if isinstance(value, tuple) else (value,)
      if self.float32_logits:
        query = query.astype(jnp.float32)
        keys = tuple(k.astype(jnp.float32) for k in keys)
      logits = kv_cache.cached_logits(f"bqhd,{kv}->bhqk", query, keys)
      logits = logits + bias.astype(logits.dtype)
      weights = jax.nn.softmax(logits).astype(self.dtype)
      if use_dropout:
        weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
      out = kv_cache.cached_mix(f"bhqk,{kv}->bqhd", weights, values)
    out = out.reshape(batch, q_len, features)
    out = nn.with_logical_constraint(out, ("batch", "length", "joined_kv"))
    return linears.DenseGeneral(
        (inputs_q.shape[-1],), ("joined_kv", "embed"), dtype=self.dtype,
        kernel_init=_t5_attention_init, name="out")(out)

  def param_fusions(self, method: str):
    """The projections `fuse_projections` may join
    (`recording_param_fusions`): a self-attention's query, key and value."""
    return ((param_recording.FUSED_T5_QKV,)
            if method == "__call__" and self.self_attention else ())
