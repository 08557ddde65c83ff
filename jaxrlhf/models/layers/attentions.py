"""Attention: the score/softmax/sum core (`attend`), the masks it reads,
and the grouped-query self-attention layer of the decoder-only families
(`Attention`: projections, rotary, the KV cache, the core).

A forward pass over whole sequences describes its mask once, as
`CausalSegments`: causal attention within each row's segments, one per row
unpacked (the attention mask's real tokens), one per packed example with
packing's `segment_ids` (positions then restart at each segment). The XLA
paths build the [length, length] mask from it (`causal_padding_mask` is
the unpacked case); the fused kernels (`attention_impl` 'splash' on TPU,
'dot_product_cudnn' on GPU; `fused_attention`) take the segment ids
themselves and never build it. Incremental decoding reads and writes the
KV cache of `kv_cache` in between rotary and `attend`.

Layers that attend differently (Gemma's sliding-window local layers between
global ones, each kind with its own rotary base in Gemma 3; Mistral's window
on every layer; Hugging Face's `layer_types`) are described by one
`LayerAttention` per layer, and each block is given its layer's index: a
Python int in an unrolled stack, a traced one in a scanned stack (its
rotary frequencies and window are then looked up from per-layer tables), so
`scan_layers` still scans one layer body and every pattern, of any length,
keeps the `layers_i` parameter layout (`decoders.make_layer_stack`). A
window only narrows the mask: the KV cache keeps every position.
"""

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import fused_attention
from jaxrlhf.models.layers import kv_cache
from jaxrlhf.models.layers import linears
from jaxrlhf.models.layers import paged_attention
from jaxrlhf.models.layers import paged_kv
from jaxrlhf.models.layers import param_recording
from jaxrlhf.models.layers import rotary

Array = jax.Array


ATTENTION_IMPLS = ("xla", "dot_product", "dot_product_cudnn", "splash")
# The implementations that take Gemma's attention-logit soft cap.
SOFTCAP_IMPLS = ("xla", "splash")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["segment_ids"],
                   meta_fields=["max_runs", "cache_length"])
@dataclasses.dataclass(frozen=True)
class CausalSegments:
  """Causal self-attention within segments: query q may attend to key k
  when k <= q and both are in one segment (and, with a sliding window, q - k
  < window). Segment id 0 is padding, every pad a segment of its own: a pad
  attends to itself only (a fully masked softmax row would be a uniform
  average, or NaN in fused kernels) and nothing attends to a pad.

  Attributes:
    segment_ids: int [batch, length]; unpacked rows pass the attention mask
      (1 = real), packed rows packing's ids (1, 2, ... per example).
    max_runs: packing's static bound on the runs of equal ids in a row (its
      examples + 1, the padding), which cuDNN's packed layout needs; None
      for the attention mask's one segment.
    cache_length: a prefill's KV cache length T (`DecoderOnly.decode_step`
      at cache index 0): the layers write their keys and values into a new
      cache of T positions and attend over their own.
  """
  segment_ids: Array
  max_runs: Optional[int] = None
  cache_length: Optional[int] = None

  def dense(self, window=None) -> Array:
    """bool [batch, 1, length, length] (query, key)."""
    ids = fused_attention.kernel_segment_ids(self.segment_ids)
    length = ids.shape[-1]
    causal = np.tril(np.ones((length, length), dtype=bool))
    mask = causal[None] & (ids[:, :, None] == ids[:, None, :])
    if window is not None:
      mask = mask & window_mask(length, length, window)[None]
    return mask[:, None]


def causal_padding_mask(attention_mask: Array) -> Array:
  """Which keys each query may attend to: earlier-or-same real tokens for a
  real query, itself for a pad (`CausalSegments` of the attention mask).

  A pad query attends to itself: a left-pad query has no earlier real key,
  and a fully masked softmax row would otherwise be a uniform average (or
  NaN in fused kernels) whose gradient is wasted work at best. No output
  of a pad is read.

  Args:
    attention_mask: [batch, length], 1 = real token, 0 = pad.
  Returns:
    bool [batch, 1, length, length] (query, key).
  """
  real = jnp.asarray(attention_mask).astype(jnp.int32)
  return CausalSegments(jnp.minimum(real, 1)).dense()


def softcap(x: Array, cap: Optional[float]) -> Array:
  """cap * tanh(x / cap): x squashed smoothly into (-cap, cap) (Gemma 2's
  attention and output logits); None leaves x as it is."""
  if cap is None:
    return x
  return jnp.tanh(x / cap) * cap


def attend(query: Array, key: Array, value: Array, mask, *,
           impl: str = "xla", scale: Optional[float] = None,
           logit_softcap: Optional[float] = None,
           cache_layout: bool = False, window=None,
           window_choices: Optional[Sequence[Optional[int]]] = None
           ) -> Array:
  """softmax(softcap(q k^T * scale) + mask) v with grouped key/value heads.

  Args:
    query: [batch, q_length, heads, head_dim].
    key, value: [batch, kv_length, kv_heads, head_dim]; heads % kv_heads == 0
      and query head h reads key/value head h // (heads // kv_heads). With
      `cache_layout` they are tuples of the KV cache's chunks [batch,
      kv_heads, chunk_length, head_dim] (`update_kv_cache`; kv_length their
      total), read in place.
    mask: bool [batch, 1, q_length, kv_length], True = may attend; or
      `CausalSegments` (self-attention, q_length == kv_length), narrowed by
      `window`.
    impl: 'xla' (einsums, softmax in float32), 'dot_product'
      (`jax.nn.dot_product_attention`, letting JAX pick the kernel),
      'dot_product_cudnn' (its cuDNN fused kernel; GPU only; with packing's
      segment ids cuDNN's packed layout, `fused_attention.cudnn`, and on
      sm90+ for unpacked rows too, whose real tokens must then be
      contiguous: `fused_attention.cudnn_unpacked`), or
      'splash' (Pallas splash attention, TPU; interpreted elsewhere;
      `fused_attention.splash`). The fused kernels read `CausalSegments`
      without building the [length, length] mask; given a dense mask (a
      decode step), 'splash' computes with the einsums of 'xla'.
    scale: the logits' multiplier (None: 1 / sqrt(head_dim)).
    logit_softcap: cap of the logits (`softcap`, before the mask); 'xla'
      and 'splash' (SOFTCAP_IMPLS).
    window: with `CausalSegments`: None, or the keys fewer than `window`
      slots back (a Python int, or a traced one of `window_choices`, the
      windows of a scanned stack's layers).
  Returns:
    [batch, q_length, heads, head_dim] in query's dtype.
  """
  batch, q_len, heads, head_dim = query.shape
  kv_heads = key[0].shape[1] if cache_layout else key.shape[2]
  if scale is None:
    scale = 1.0 / np.sqrt(head_dim)
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={impl!r} is not supported; choose one "
                     f"of {list(ATTENTION_IMPLS)}.")
  if logit_softcap is not None and impl not in SOFTCAP_IMPLS:
    raise ValueError(f"attention_impl={impl!r} cannot soft-cap attention "
                     f"logits; use one of {list(SOFTCAP_IMPLS)}.")
  if isinstance(mask, CausalSegments):
    if impl == "splash":
      return fused_attention.splash(
          query, key, value, mask.segment_ids, scale=scale, window=window,
          window_choices=window_choices, logit_softcap=logit_softcap)
    if impl == "dot_product_cudnn" and mask.max_runs is not None:
      return fused_attention.cudnn(query, key, value, mask.segment_ids,
                                   max_runs=mask.max_runs, scale=scale,
                                   window=window)
    if (impl == "dot_product_cudnn" and mask.cache_length is None
        and (window is None or isinstance(window, (int, np.integer)))
        and fused_attention.packed_layout_available()):
      return fused_attention.cudnn_unpacked(query, key, value,
                                            mask.segment_ids, scale=scale,
                                            window=window)
    mask = mask.dense(window)
  elif window is not None:
    raise ValueError("attend: a window narrows CausalSegments only; narrow a "
                     "dense mask with window_mask.")
  if impl in ("xla", "splash") or cache_layout:
    # Decoding reads the cache in its own layout with these einsums (one
    # query position: a fused kernel gains nothing there).
    kv = "bksh" if cache_layout else "bskh"
    keys, values = (key, value) if cache_layout else ((key,), (value,))
    groups = heads // kv_heads
    query = query.reshape(batch, q_len, kv_heads, groups, head_dim)
    logits = kv_cache.cached_logits(f"btkgh,{kv}->bkgts", query, keys,
                                    preferred_element_type=jnp.float32) * scale
    logits = softcap(logits, logit_softcap)
    logits = jnp.where(mask[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(values[0].dtype)
    out = kv_cache.cached_mix(f"bkgts,{kv}->btkgh", probs, values)
    return out.reshape(batch, q_len, heads, head_dim)
  implementation = "cudnn" if impl == "dot_product_cudnn" else None
  return jax.nn.dot_product_attention(
      query, key, value, mask=mask, scale=scale,
      implementation=implementation).astype(query.dtype)



def window_mask(q_length: int, k_length: int, window,
                cache_index=None) -> Array:
  """bool [q_length, k_length]: key slot k is fewer than `window` slots
  before query slot q (k <= q is the causal mask's business). Queries sit
  at slots 0 .. q_length - 1, or at cache_index + 0 .. when decoding with a
  cache of k_length slots. Slots are array positions: with left padding and
  no gaps they are the real tokens' position differences. `window` may be
  traced (a scanned layer's, `layer_rope_and_window`)."""
  offset = 0 if cache_index is None else cache_index
  query_slots = offset + jnp.arange(q_length)
  return (query_slots[:, None] - jnp.arange(k_length)[None, :]) < window


# Hugging Face's `layer_types` names: how a layer attends.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
# The window of a layer without one when the window is looked up per layer.
NO_WINDOW = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class LayerAttention:
  """How one layer attends: its rotary base and scaling, and its window
  (the keys fewer than `sliding_window` positions back; None: all earlier
  keys). A model whose layers attend differently (Gemma's local and global
  layers, each with its own rotary base in Gemma 3) gives `Attention` one
  per layer (`layer_kinds`)."""
  rope_theta: float = 10000.0
  rope_scaling: Optional[rotary.RopeScaling] = None
  sliding_window: Optional[int] = None


def layer_rope_and_window(kinds: Sequence[LayerAttention], layer,
                          rotary_dim: int):
  """The rotary frequencies and the window of layer `layer` of `kinds`.

  Args:
    kinds: one `LayerAttention` per layer of the stack.
    layer: the layer's index: a Python int (an unrolled stack), or a traced
      int32 scalar (a scanned stack, whose one layer body serves every
      layer); None when every layer attends alike.
    rotary_dim: the rotated channels of a head.
  Returns:
    (inv_freq [ceil(rotary_dim / 2)], window). Static (numpy, int or None)
    when the layer is known or every layer shares the value; otherwise
    looked up from per-layer tables with the traced index, a layer without
    a window getting NO_WINDOW (no limit).
  """
  of_kind = {k: rotary.rope_inverse_frequencies(rotary_dim, k.rope_theta,
                                                k.rope_scaling)
             for k in set(kinds)}
  freqs = [of_kind[k] for k in kinds]
  windows = [k.sliding_window for k in kinds]
  if isinstance(layer, (int, np.integer)):
    return freqs[layer], windows[layer]
  same_freqs = all(np.array_equal(f, freqs[0]) for f in freqs)
  same_windows = len(set(windows)) == 1
  if layer is None and not (same_freqs and same_windows):
    raise ValueError("Layers that attend differently need their index "
                     "(DecoderOnly's index_layers).")
  inv_freq = freqs[0] if same_freqs else jnp.asarray(np.stack(freqs))[layer]
  if same_windows:
    return inv_freq, windows[0]
  table = np.array([NO_WINDOW if w is None else w for w in windows], np.int32)
  return inv_freq, jnp.asarray(table)[layer]



class Attention(nn.Module):
  """Multi-head self-attention with grouped-query heads and rotary positions.

  Parameters: query/kernel [embed, heads, kv], key/kernel and value/kernel
  [embed, kv_heads, kv], out/kernel [heads, kv, embed]; biases of the
  query, key and value projections with `qkv_bias` (Qwen2, GPT-NeoX), of
  the output projection with `out_bias` (GPT-NeoX); with `qk_norm`, a norm
  over each head's channels of the queries and of the keys before the
  rotation (`query_norm`, `key_norm`: Qwen3, Gemma 3). With `layer_kinds`,
  each layer of the stack has its own rotary base and window (Gemma's local
  and global layers, Mistral's window), picked by the layer's index.
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rotary_dim: int
  rope_theta: float = 10000.0
  rope_scaling: Optional[rotary.RopeScaling] = None
  qkv_bias: bool = False
  out_bias: bool = False
  # (name) -> a module normalising the last axis (head_dim) of queries and
  # keys, or None.
  qk_norm: Optional[Callable[[str], nn.Module]] = None
  dtype: Any = jnp.float32
  attention_impl: str = "xla"
  # The logits' multiplier (None: 1 / sqrt(head_dim); Gemma's is
  # query_pre_attn_scalar ** -0.5).
  query_scale: Optional[float] = None
  # Soft cap of the attention logits (`softcap`); None: none.
  logit_softcap: Optional[float] = None
  # One `LayerAttention` per layer of the stack (then rope_theta and
  # rope_scaling are not read): the layer's index (`__call__`'s `layer`)
  # picks its rotary frequencies and its window.
  layer_kinds: Tuple[LayerAttention, ...] = ()

  @nn.compact
  def __call__(self, x: Array, positions: Array, mask: Array,
               cache_index: Optional[Array] = None, layer=None) -> Array:
    """x [batch, length, embed], positions [batch, length], mask the
    forward pass's `CausalSegments` (or a dense bool [batch, 1, length,
    length]) -> [batch, length, embed]. `layer`: this layer's index in the
    stack, with `layer_kinds` (`layer_rope_and_window`).

    With `cache_index` (incremental decoding; apply with mutable=["cache"]):
    the rotated keys and the values of the `length` inputs are written at
    positions [cache_index, cache_index + length) of `cached_key` /
    `cached_value` [batch, kv_heads, T, head_dim], T = mask.shape[-1]
    (created as zeros on the first call), and the queries attend over all T
    cached positions (a cache in chunks, `kv_cache_chunks`: over its first
    T); `mask` [batch, 1, length, T] (from `cache_mask`) hides the pads and
    the positions not written yet. With a `paged_kv.PagedIndex` as
    cache_index, the cache is the page pools of `paged_kv.make_pool`, read
    and written through the index's page tables (`paged_kv.update_paged`),
    and the queries attend over the pages in use (`paged_attention`;
    `mask`, `paged_kv.paged_mask`'s, is read only where it gathers each
    row's whole table, `paged_attention.choose`). A prefill may instead
    pass
    `CausalSegments` with their cache_length T: the cache is written the
    same way and the queries attend over their own keys.
    """
    def project(out):  # the heads' outputs [batch, length, heads, kv]
      out = nn.with_logical_constraint(out, ("batch", "length", "heads",
                                             "kv"))
      return linears.DenseGeneral((x.shape[-1],), ("heads", "kv", "embed"),
                                  num_in_axes=2, use_bias=self.out_bias,
                                  dtype=self.dtype, name="out")(out)

    def projection(heads, head_axis, name):
      return linears.DenseGeneral(
          (heads, self.head_dim), ("embed", head_axis, "kv"),
          use_bias=self.qkv_bias, dtype=self.dtype, name=name)

    if self.has_variable("params", param_recording.FUSED_QKV.name):
      # The three projections joined along heads (`fuse_projections`).
      joined = projection(self.num_heads + 2 * self.num_kv_heads, "heads",
                          param_recording.FUSED_QKV.name)(x)
      query, key, value = jnp.split(
          joined, (self.num_heads, self.num_heads + self.num_kv_heads),
          axis=-2)
    else:
      query = projection(self.num_heads, "heads", "query")(x)
      key = projection(self.num_kv_heads, "kv_heads", "key")(x)
      value = projection(self.num_kv_heads, "kv_heads", "value")(x)
    if self.qk_norm is not None:
      query = self.qk_norm("query_norm")(query)
      key = self.qk_norm("key_norm")(key)
    if self.layer_kinds:
      inv_freq, window = layer_rope_and_window(self.layer_kinds, layer,
                                               self.rotary_dim)
    else:
      inv_freq = rotary.rope_inverse_frequencies(
          self.rotary_dim, self.rope_theta, self.rope_scaling)
      window = None
    query = rotary.apply_rotary_embedding(query, positions, inv_freq)
    key = rotary.apply_rotary_embedding(key, positions, inv_freq)
    kv_axes = ("batch", "length", "kv_heads", "kv")
    query = nn.with_logical_constraint(query, ("batch", "length", "heads", "kv"))
    key = nn.with_logical_constraint(key, kv_axes)
    value = nn.with_logical_constraint(value, kv_axes)
    segments = isinstance(mask, CausalSegments)
    paged = isinstance(cache_index, paged_kv.PagedIndex)
    if paged:
      # A paged cache (`paged_kv`): write the new keys and values into the
      # page pools, then read the pages in use (or, with read 'gather',
      # each row's whole table gathered back).
      if segments:
        raise ValueError("A paged KV-cache call takes the dense mask of "
                         "kv_cache.cache_mask, not CausalSegments.")
      key = paged_kv.update_paged(self, "cached_key", key, cache_index)
      value = paged_kv.update_paged(self, "cached_value", value, cache_index)
      if paged_attention.choose(cache_index, query.shape[1], window,
                                key) != "gather":
        out = paged_attention.attend(
            query, key, value, cache_index,
            scale=(self.query_scale if self.query_scale is not None
                   else 1.0 / np.sqrt(self.head_dim)),
            logit_softcap=self.logit_softcap, window=window)
        return project(out)
      key = (paged_kv.gather_pages(key, cache_index.page_table),)
      value = (paged_kv.gather_pages(value, cache_index.page_table),)
    elif cache_index is not None:
      # A prefill described by CausalSegments (`DecoderOnly.decode_step`)
      # fills the cache and attends over its own keys, which are all the
      # cache holds yet; other calls attend over the whole cache.
      cache_length = mask.cache_length if segments else mask.shape[-1]
      if cache_length is None:
        raise ValueError("A KV-cache call with CausalSegments must give "
                         "their cache_length (a prefill).")
      cached_key = kv_cache.update_kv_cache(
          self, "cached_key", key, cache_index, cache_length, "kv_heads")
      cached_value = kv_cache.update_kv_cache(
          self, "cached_value", value, cache_index, cache_length, "kv_heads")
      if not segments:
        key, value = cached_key, cached_value
    window_choices = None
    if segments:
      if window is not None and not isinstance(window, (int, np.integer)):
        window_choices = tuple(k.sliding_window for k in self.layer_kinds)
    elif window is not None and paged:
      mask = mask & paged_kv.paged_window_mask(cache_index, mask.shape[-2],
                                               window)
      window = None
    elif window is not None:
      mask = mask & window_mask(mask.shape[-2], mask.shape[-1], window,
                                cache_index)
      window = None
    out = attend(query, key, value, mask, impl=self.attention_impl,
                 scale=self.query_scale, logit_softcap=self.logit_softcap,
                 cache_layout=cache_index is not None and not segments,
                 window=window, window_choices=window_choices)
    return project(out)

  def param_fusions(self, method: str):
    """The projections `fuse_projections` may join
    (`recording_param_fusions`)."""
    return (param_recording.FUSED_QKV,) if method == "__call__" else ()
