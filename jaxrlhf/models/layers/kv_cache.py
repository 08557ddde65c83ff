"""The KV cache of incremental decoding.

The cache slots in between rotary and `attentions.attend`: with a
`cache_index`, an attention layer writes its rotated keys and its values
into the flax "cache" collection (`cached_key` / `cached_value` [batch,
kv_heads, T, head_dim], stacked along 'layers' when scanned) with
`update_kv_cache`, and attends over all T cached positions with
`cache_mask`. `decoders.DecoderOnly.decode_step` is the entry point: one
prefill call over a left-padded prompt (rotary positions from its mask),
then one call per new token, each with `mutable=["cache"]`. A cache made in
`kv_cache_chunks` is held in chunks, and a call reads only the chunks its
mask covers. A window (`attentions.window_mask`) only narrows the mask: the
cache keeps every position.

The interface the layers (`attentions.Attention`, `t5_attention.T5Attention`'s
self-attention, `decoders.DecoderOnly`) and the sampler use, all that a
replacement of this cache must give them (T5's cross-attention cache,
written once per sample, is `T5Attention`'s own):
  update_kv_cache(module, name, new, cache_index, cache_length, head_axis)
    -> the cache's first cache_length positions, a tuple of chunks [batch,
       heads, length, head_dim];
  cached_logits(spec, query, keys) / cached_mix(spec, probs, values): the
    attention's two einsums over those chunks, read in place;
  cache_mask(attention_mask, cache_index, length): which cached keys each
    new query may attend to;
  kv_cache_chunks(lengths): the context in which a sampler makes its caches
    (`sampling`'s cache segments).
A paged cache (`paged_kv`: page pools and page tables) replaces the
contiguous one when a call's cache_index is a `paged_kv.PagedIndex`
(`attentions.Attention` only).
"""

import contextlib
import threading
from typing import Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models.layers import paged_kv

Array = jax.Array


# The lengths of `kv_cache_chunks`, innermost last, per thread (a trace in
# another thread makes its own caches).
_KV_CACHE_CHUNKS = threading.local()


def _cache_chunks() -> list:
  if not hasattr(_KV_CACHE_CHUNKS, "stack"):
    _KV_CACHE_CHUNKS.stack = []
  return _KV_CACHE_CHUNKS.stack


@contextlib.contextmanager
def kv_cache_chunks(lengths: Sequence[int]):
  """KV caches created inside (`update_kv_cache`, at the prefill) are held
  as chunks: the prefill's `cache_length` positions, then a zero chunk of
  each of `lengths` positions. A later call whose mask covers the first T
  positions, T the end of a chunk, writes into that chunk and attends over
  the chunks up to it only: a sampler's decode steps then read the part of
  the cache written so far, each chunk in place, not the whole cache
  (`sampling`'s cache segments)."""
  _cache_chunks().append(tuple(int(n) for n in lengths))
  try:
    yield
  finally:
    _cache_chunks().pop()


def update_kv_cache(module: nn.Module, name: str, new: Array, cache_index,
                    cache_length: int, head_axis: str) -> Tuple[Array, ...]:
  """Writes `new` [batch, L, heads, head_dim] into the cache variable `name`
  at [cache_index, cache_index + L) along length; returns the cache's first
  `cache_length` positions as a tuple of its chunks [batch, heads, length,
  head_dim] (read by `cached_logits` and `cached_mix`): one chunk, the
  whole cache, unless it was created in `kv_cache_chunks`. Created as
  zeros if absent, with cache_length positions (and the chunks of
  `kv_cache_chunks`). With chunks, cache_length must end one, and the L
  positions must lie in it.

  The cache keeps heads before length so that a decode step's attention
  (`attend(..., cache_layout=True)`, batch and heads leading) reads it in
  place: laid out as [batch, length, heads, head_dim], XLA transposed the
  whole cache of every layer at every step, so decoding cost grew with the
  cache instead of with the new position. Chunks (not slices of one array)
  keep that: XLA copies a cache that a step both slices and updates.
  """
  if isinstance(cache_index, paged_kv.PagedIndex):
    raise ValueError(f"KV cache {name!r}: a paged cache is read by "
                     "attentions.Attention only; decode this model with the "
                     "contiguous cache.")
  batch, _, heads, head_dim = new.shape

  def create():
    later = _cache_chunks()
    lengths = (cache_length,) + (later[-1] if later else ())
    zeros = tuple(jnp.zeros((batch, heads, n, head_dim), new.dtype)
                  for n in lengths)
    return zeros if len(zeros) > 1 else zeros[0]
  var = module.variable("cache", name, create)
  chunks = var.value if isinstance(var.value, tuple) else (var.value,)
  ends = np.cumsum([c.shape[2] for c in chunks]).tolist()
  if cache_length not in ends:
    raise ValueError(
        f"KV cache {name!r}: a call attending over {cache_length} positions "
        f"of a cache in chunks ending at {ends}; it must end a chunk.")
  last = ends.index(cache_length)
  zero = jnp.zeros((), jnp.int32)
  start = jnp.asarray(cache_index, jnp.int32)
  if last:  # the chunk's own position
    start = start - ends[last - 1]
  written = nn.with_logical_constraint(
      jax.lax.dynamic_update_slice(
          chunks[last], jnp.swapaxes(new, 1, 2).astype(chunks[last].dtype),
          (zero, zero, start, zero)),
      ("batch", head_axis, "length", "kv"))
  chunks = chunks[:last] + (written,) + chunks[last + 1:]
  var.value = chunks if len(chunks) > 1 else written
  return chunks[:last + 1]


def cached_logits(spec: str, query: Array, keys: Tuple[Array, ...],
                  **einsum_options) -> Array:
  """The attention logits of `query` against the cache's key chunks
  (`update_kv_cache`), `jnp.einsum(spec, query, key)` per chunk, joined
  along the last axis (the keys')."""
  logits = [jnp.einsum(spec, query, k, **einsum_options) for k in keys]
  return logits[0] if len(logits) == 1 else jnp.concatenate(logits, -1)


def cached_mix(spec: str, probs: Array, values: Tuple[Array, ...]) -> Array:
  """`jnp.einsum(spec, probs, value)` over the cache's value chunks (length
  their second-to-last axis): each chunk's share of `probs` (last axis),
  summed in float32 when there are several."""
  if len(values) == 1:
    return jnp.einsum(spec, probs, values[0])
  splits = np.cumsum([v.shape[-2] for v in values])[:-1].tolist()
  out = sum(jnp.einsum(spec, p, v, preferred_element_type=jnp.float32)
            for p, v in zip(jnp.split(probs, splits, axis=-1), values))
  return out.astype(values[0].dtype)


def cache_mask(attention_mask: Array, cache_index, length: int) -> Array:
  """The attention mask of `length` queries at cache positions cache_index ..
  cache_index + length - 1 over all T cached keys.

  Same rule as `causal_padding_mask`: earlier-or-same real keys, and always
  the query's own position.

  Args:
    attention_mask: [batch, T], 1 = real token (prompt pads 0; positions to
      be generated 1).
    cache_index: int scalar (may be traced).
    length: static number of queries.
  Returns:
    bool [batch, 1, length, T]; with a `paged_kv.PagedIndex` as cache_index
    (a paged cache; attention_mask unused), `paged_kv.paged_mask`'s [batch,
    1, length, max_pages x page_size].
  """
  if isinstance(cache_index, paged_kv.PagedIndex):
    return paged_kv.paged_mask(cache_index, length)
  real = jnp.asarray(attention_mask).astype(bool)
  query_slots = cache_index + jnp.arange(length)
  key_slots = jnp.arange(real.shape[-1])
  causal = key_slots[None, :] <= query_slots[:, None]
  itself = key_slots[None, :] == query_slots[:, None]
  mask = (causal[None] & real[:, None, :]) | itself[None]
  return mask[:, None]
