"""Building blocks shared by the decoder-only model families.

Llama-style and GPT-NeoX-style transformers differ only in which of these
blocks they use and how they wire them: RMSNorm vs LayerNorm, full vs partial
rotary embeddings, gated (SwiGLU) vs plain GELU MLPs, biases or none,
sequential vs parallel residual. Everything here is Flax Linen with
float32 parameters, a configurable compute `dtype`, logical axis names on
every parameter and logical constraints on the large activations.

Logical axis names used: batch, length, embed, mlp, heads, kv_heads, kv,
vocab, layers. `kv_heads` is the key/value head axis of grouped-query
attention; it has its own name because it is often smaller than the model
axis of a mesh that shards `heads` (Llama 3 8B has 8 key/value heads and 32
query heads), so a sharding plan may replicate it or shard it differently.

Attention is split into projection (`Attention`), position encoding
(`apply_rotary_embedding`) and the score/softmax/sum core (`attend`). A
forward pass over whole sequences describes its mask once, as
`CausalSegments`: causal attention within each row's segments, one per row
unpacked (the attention mask's real tokens), one per packed example with
packing's `segment_ids` (positions then restart at each segment). The XLA
paths build the [length, length] mask from it (`causal_padding_mask` is
the unpacked case); the fused kernels (`attention_impl` 'splash' on TPU,
'dot_product_cudnn' on GPU; `fused_attention`) take the segment ids
themselves and never build it. The KV cache for
incremental decoding slots in between rotary and `attend`: with a
`cache_index`, `Attention` writes the rotated keys and the values into the
flax "cache" collection (`cached_key` / `cached_value` [batch, kv_heads, T,
head_dim], stacked along 'layers' when scanned) and attends over all T cached
positions with `cache_mask`. `DecoderOnly.decode_step` is the entry point:
one prefill call over a left-padded prompt (rotary positions from its mask),
then one call per new token, each with `mutable=["cache"]`. A cache made in
`kv_cache_chunks` is held in chunks, and a call reads only the chunks its
mask covers (`update_kv_cache`).

Layers that attend differently (Gemma's sliding-window local layers between
global ones, each kind with its own rotary base in Gemma 3; Mistral's window
on every layer; Hugging Face's `layer_types`) are described by one
`LayerAttention` per layer, and each block is given its layer's index: a
Python int in an unrolled stack, a traced one in a scanned stack (its
rotary frequencies and window are then looked up from per-layer tables), so
`scan_layers` still scans one layer body and every pattern, of any length,
keeps the `layers_i` parameter layout. A window only narrows the mask: the
KV cache keeps every position.
"""

import contextlib
import dataclasses
import functools
import operator
import threading
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import checks
from jaxrlhf.models import fused_attention

Array = jax.Array

ATTENTION_IMPLS = ("xla", "dot_product", "dot_product_cudnn", "splash")
# The implementations that take Gemma's attention-logit soft cap.
SOFTCAP_IMPLS = ("xla", "splash")

# 'none' keeps every activation; 'full' recomputes the whole layer in the
# backward pass; the rest are jax.checkpoint_policies names.
REMAT_POLICIES = ("none", "full", "dots_saveable",
                  "dots_with_no_batch_dims_saveable", "nothing_saveable",
                  "everything_saveable")


def check_dtype(value, field="dtype"):
  try:
    jnp.dtype(value)
  except TypeError as e:
    raise ValueError(f"{field}={value!r} is not a dtype name (e.g. 'float32', "
                     "'bfloat16').") from e


# ----------------------------------------------------------------------------
# Initialisers.

def kernel_init(num_in_axes: int, num_out_axes: int):
  """LeCun-normal (truncated) with fan-in over all leading input axes, for a
  kernel [*in_axes, *out_axes]."""
  return nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal",
      in_axis=tuple(range(num_in_axes)),
      out_axis=tuple(range(num_in_axes, num_in_axes + num_out_axes)))


def default_embedding_init():
  # Std 1/sqrt(embed): tied output logits h @ E^T of a normalised h are O(1).
  return nn.initializers.variance_scaling(1.0, "fan_in", "normal",
                                          in_axis=1, out_axis=0)


def _boxed(init, names):
  return nn.with_logical_partitioning(init, names)


class DenseGeneral(nn.Module):
  """y = x . kernel over the last `num_in_axes` axes of x, plus a bias.

  The kernel [*in_shape, *features] is created at its full shape with its
  logical names (flax's DenseGeneral initialises a flattened 2-D kernel and
  reshapes it, which fails under a mesh with logical rules active, because
  the 2-D value is constrained with the multi-axis names).

  LoRA (`jaxrlhf.models.lora`): when the parameters given to `apply` hold
  `lora_a` [*in_shape, r] and `lora_b` [r, *features] beside the kernel
  (the adapters' view of a frozen base, B already times alpha / r), the
  output is x . kernel + (x . lora_a) . lora_b; without them it is the
  base alone. `lora_dropout_key` (uint32 [2]) and `lora_dropout_rate`
  (float32 []), present only in training, drop x's entries on the
  adapters' path alone.
  """
  features: Sequence[int]
  kernel_axes: Sequence[str]
  num_in_axes: int = 1
  use_bias: bool = False
  dtype: Any = jnp.float32
  # None: LeCun-normal (truncated) over the input axes (`kernel_init`).
  kernel_init: Optional[Callable] = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = tuple(self.features)
    n_in = self.num_in_axes
    init = self.kernel_init or kernel_init(n_in, len(features))
    kernel = self.param(
        "kernel", _boxed(init, tuple(self.kernel_axes)),
        x.shape[x.ndim - n_in:] + features, jnp.float32)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    y = jax.lax.dot_general(x.astype(self.dtype), kernel.astype(self.dtype),
                            (contract, ((), ())))
    if self.has_variable("params", "lora_a"):
      y = y + self._lora(x, contract)
    if self.use_bias:
      bias = self.param(
          "bias", _boxed(nn.initializers.zeros,
                         tuple(self.kernel_axes[n_in:])),
          features, jnp.float32)
      y = y + bias.astype(self.dtype)
    return y

  def _lora(self, x: Array, contract) -> Array:
    """(x . lora_a) . lora_b: the adapters' low-rank update (class doc)."""
    lora_a = self.get_variable("params", "lora_a").astype(self.dtype)
    lora_b = self.get_variable("params", "lora_b").astype(self.dtype)
    if self.has_variable("params", "lora_dropout_key"):
      rate = self.get_variable("params", "lora_dropout_rate")
      keep = jax.random.bernoulli(
          self.get_variable("params", "lora_dropout_key"), 1.0 - rate,
          x.shape)
      x = jnp.where(keep, x / (1.0 - rate).astype(x.dtype),
                    jnp.zeros((), x.dtype))
    h = jax.lax.dot_general(x.astype(self.dtype), lora_a,
                            (contract, ((), ())))
    return jax.lax.dot_general(h, lora_b, (((h.ndim - 1,), (0,)), ((), ())))

  def param_read_dtypes(self, method: str):
    """{parameter: the dtype `method` casts it to at every read}
    (`recording_param_reads`). The LoRA factors are read cast too but are
    left out: a fraction of a percent of the weights, casting them once
    saves nothing, and it cost the LoRA GRPO plans' sampling 0.5 GiB of
    XLA's temporaries (experiments/results/plans)."""
    return {"kernel": self.dtype, "bias": self.dtype} if method == "__call__" \
        else {}


# ----------------------------------------------------------------------------
# Normalisation.

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
    scale = self.param("scale", _boxed(nn.initializers.ones,
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
    scale = self.param("scale", _boxed(nn.initializers.ones, ("embed",)),
                       (features,), jnp.float32)
    bias = self.param("bias", _boxed(nn.initializers.zeros, ("embed",)),
                      (features,), jnp.float32)
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
    return (normed * scale + bias).astype(self.dtype)


# ----------------------------------------------------------------------------
# Rotary position embeddings.

@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Context-extension rescaling of the rotary frequencies.

  kind='llama3' is Llama 3.1/3.2's scheme: wavelengths longer than
  original_max_length / low_freq_factor are slowed by `factor`, shorter than
  original_max_length / high_freq_factor kept, and those between interpolated.
  kind='linear' divides every frequency by `factor` (position interpolation).
  """
  kind: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_length: int = 8192

  def __post_init__(self):
    checks.check_choice("RopeScaling", "kind", self.kind, ("llama3", "linear"))


def rotated_channels(rotary_dim: int) -> int:
  """How many channels a rotary dimension rotates: itself, or one more when
  odd (see `rope_inverse_frequencies`)."""
  return 2 * -(-rotary_dim // 2)


def rope_inverse_frequencies(rotary_dim: int, theta: float,
                             scaling: Optional[RopeScaling] = None
                             ) -> np.ndarray:
  """The rotation frequency of each pair of rotated channels.

  An odd `rotary_dim` d (GPT-NeoX's int(head_dim * rotary_pct), e.g. 12 *
  0.25 = 3) gives ceil(d / 2) frequencies, still with exponents 2i / d, and
  `apply_rotary_embedding` then rotates 2 * ceil(d / 2) = d + 1 channels:
  what transformers computes (its inverse frequencies are
  theta ** -(arange(0, d, 2) / d), and it rotates as many channels as its
  cos/sin tables have, twice their count).

  Returns:
    float32 [ceil(rotary_dim / 2)]: theta ** (-2i / rotary_dim), rescaled.
  """
  exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim
  inv_freq = (1.0 / np.float32(theta) ** exponents).astype(np.float32)
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
  # llama3: piecewise in wavelength (computed in float32 as the reference).
  factor = np.float32(scaling.factor)
  low_wavelen = np.float32(scaling.original_max_length / scaling.low_freq_factor)
  high_wavelen = np.float32(
      scaling.original_max_length / scaling.high_freq_factor)
  wavelen = np.float32(2 * np.pi) / inv_freq
  slowed = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = ((scaling.original_max_length / wavelen - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  smoothed = (1 - smooth) * slowed / factor + smooth * slowed
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(is_medium, smoothed, slowed).astype(np.float32)


def apply_rotary_embedding(x: Array, positions: Array, inv_freq: np.ndarray
                           ) -> Array:
  """Rotates the first 2 * len(inv_freq) channels of every head.

  Uses the "rotate half" pairing of Hugging Face / GPT-NeoX checkpoints:
  channel i is paired with channel i + rotary_dim / 2 (not i + 1 as in Meta's
  original Llama code, whose checkpoints HF permutes at conversion time).
  Channels beyond rotary_dim pass through (GPT-NeoX's partial rotary).

  Args:
    x: [batch, length, heads, head_dim].
    positions: [batch, length] integer positions.
    inv_freq: [rotary_dim // 2] from `rope_inverse_frequencies`.
  Returns:
    [batch, length, heads, head_dim] in x's dtype.
  """
  rotary_dim = 2 * inv_freq.shape[0]
  if rotary_dim == 0:
    return x
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
  x_rot = x_rot.astype(jnp.float32)
  first, second = jnp.split(x_rot, 2, axis=-1)
  rotated_half = jnp.concatenate([-second, first], axis=-1)
  x_rot = (x_rot * cos + rotated_half * sin).astype(x.dtype)
  return jnp.concatenate([x_rot, x_pass], axis=-1)


# ----------------------------------------------------------------------------
# Attention.

def positions_from_mask(attention_mask: Array) -> Array:
  """Positions for left- or right-padded rows: cumsum(mask) - 1, clipped at 0.

  Args:
    attention_mask: [batch, length], 1 = real token, 0 = pad.
  Returns:
    int32 [batch, length]; the first real token of each row is position 0.
  """
  mask = jnp.asarray(attention_mask).astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)


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
    logits = cached_logits(f"btkgh,{kv}->bkgts", query, keys,
                           preferred_element_type=jnp.float32) * scale
    logits = softcap(logits, logit_softcap)
    logits = jnp.where(mask[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(values[0].dtype)
    out = cached_mix(f"bkgts,{kv}->btkgh", probs, values)
    return out.reshape(batch, q_len, heads, head_dim)
  implementation = "cudnn" if impl == "dot_product_cudnn" else None
  return jax.nn.dot_product_attention(
      query, key, value, mask=mask, scale=scale,
      implementation=implementation).astype(query.dtype)


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
    bool [batch, 1, length, T].
  """
  real = jnp.asarray(attention_mask).astype(bool)
  query_slots = cache_index + jnp.arange(length)
  key_slots = jnp.arange(real.shape[-1])
  causal = key_slots[None, :] <= query_slots[:, None]
  itself = key_slots[None, :] == query_slots[:, None]
  mask = (causal[None] & real[:, None, :]) | itself[None]
  return mask[:, None]


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
  rope_scaling: Optional[RopeScaling] = None
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
  of_kind = {k: rope_inverse_frequencies(rotary_dim, k.rope_theta,
                                         k.rope_scaling) for k in set(kinds)}
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
  rope_scaling: Optional[RopeScaling] = None
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
    the positions not written yet. A prefill may instead pass
    `CausalSegments` with their cache_length T: the cache is written the
    same way and the queries attend over their own keys.
    """
    def projection(heads, head_axis, name):
      return DenseGeneral((heads, self.head_dim), ("embed", head_axis, "kv"),
                          use_bias=self.qkv_bias, dtype=self.dtype, name=name)

    if self.has_variable("params", FUSED_QKV.name):
      # The three projections joined along heads (`fuse_projections`).
      joined = projection(self.num_heads + 2 * self.num_kv_heads, "heads",
                          FUSED_QKV.name)(x)
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
      inv_freq = rope_inverse_frequencies(self.rotary_dim, self.rope_theta,
                                          self.rope_scaling)
      window = None
    query = apply_rotary_embedding(query, positions, inv_freq)
    key = apply_rotary_embedding(key, positions, inv_freq)
    kv_axes = ("batch", "length", "kv_heads", "kv")
    query = nn.with_logical_constraint(query, ("batch", "length", "heads", "kv"))
    key = nn.with_logical_constraint(key, kv_axes)
    value = nn.with_logical_constraint(value, kv_axes)
    segments = isinstance(mask, CausalSegments)
    if cache_index is not None:
      # A prefill described by CausalSegments (`DecoderOnly.decode_step`)
      # fills the cache and attends over its own keys, which are all the
      # cache holds yet; other calls attend over the whole cache.
      cache_length = mask.cache_length if segments else mask.shape[-1]
      if cache_length is None:
        raise ValueError("A KV-cache call with CausalSegments must give "
                         "their cache_length (a prefill).")
      cached_key = update_kv_cache(self, "cached_key", key, cache_index,
                                   cache_length, "kv_heads")
      cached_value = update_kv_cache(self, "cached_value", value,
                                     cache_index, cache_length, "kv_heads")
      if not segments:
        key, value = cached_key, cached_value
    window_choices = None
    if segments:
      if window is not None and not isinstance(window, (int, np.integer)):
        window_choices = tuple(k.sliding_window for k in self.layer_kinds)
    elif window is not None:
      mask = mask & window_mask(mask.shape[-2], mask.shape[-1], window,
                                cache_index)
      window = None
    out = attend(query, key, value, mask, impl=self.attention_impl,
                 scale=self.query_scale, logit_softcap=self.logit_softcap,
                 cache_layout=cache_index is not None and not segments,
                 window=window, window_choices=window_choices)
    out = nn.with_logical_constraint(out, ("batch", "length", "heads", "kv"))
    return DenseGeneral((x.shape[-1],), ("heads", "kv", "embed"),
                        num_in_axes=2, use_bias=self.out_bias,
                        dtype=self.dtype, name="out")(out)

  def param_fusions(self, method: str):
    """The projections `fuse_projections` may join
    (`recording_param_fusions`)."""
    return (FUSED_QKV,) if method == "__call__" else ()


# ----------------------------------------------------------------------------
# T5-style attention: relative-position bias, no scaling, joined heads.
#
# The t5x families (T5 and t5x's decoder-only model) use these: one
# bucketed relative-position bias table per stack, added (with the mask, as
# -1e10) to unscaled attention logits (1/sqrt(head_dim) is folded into the
# query initialisation), and 2-D projection kernels [embed, heads * kv]
# (t5x's 'joined_kv' layout).

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
    project = functools.partial(DenseGeneral, (features,),
                                ("embed", "joined_kv"), dtype=self.dtype,
                                kernel_init=_t5_attention_init)
    batch, q_len = inputs_q.shape[0], inputs_q.shape[1]
    head_axes = ("batch", "length", "heads", "kv")
    joined = None
    if self.self_attention and self.has_variable("params",
                                                 FUSED_T5_QKV.name):
      # The three projections joined (`fuse_projections`).
      joined = jnp.split(
          DenseGeneral((3 * features,), ("embed", "joined_kv"),
                       dtype=self.dtype, name=FUSED_T5_QKV.name)(inputs_q),
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
        key = update_kv_cache(self, "cached_key", key, cache_index,
                              bias.shape[-1], "heads")
        value = update_kv_cache(self, "cached_value", value, cache_index,
                                bias.shape[-1], "heads")
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
      logits = cached_logits(f"bqhd,{kv}->bhqk", query, keys)
      logits = logits + bias.astype(logits.dtype)
      weights = jax.nn.softmax(logits).astype(self.dtype)
      if use_dropout:
        weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
      out = cached_mix(f"bhqk,{kv}->bqhd", weights, values)
    out = out.reshape(batch, q_len, features)
    out = nn.with_logical_constraint(out, ("batch", "length", "joined_kv"))
    return DenseGeneral((inputs_q.shape[-1],), ("joined_kv", "embed"),
                        dtype=self.dtype, kernel_init=_t5_attention_init,
                        name="out")(out)

  def param_fusions(self, method: str):
    """The projections `fuse_projections` may join
    (`recording_param_fusions`): a self-attention's query, key and value."""
    return ((FUSED_T5_QKV,) if method == "__call__" and self.self_attention
            else ())


# t5x's MLP activation names -> `ACTIVATIONS` (t5x's 'gelu' is the tanh
# approximation; ours, as Hugging Face's, is the exact erf form).
T5_ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu", "linear": "linear",
                  "silu": "silu"}


def t5_mlp_activations(names: Sequence[str]) -> Tuple[str, ...]:
  """t5x activation names as `Mlp` activations."""
  for name in names:
    if name not in T5_ACTIVATIONS:
      raise ValueError(f"Unknown MLP activation {name!r}; choose from "
                       f"{sorted(T5_ACTIVATIONS)}.")
  return tuple(T5_ACTIVATIONS[n] for n in names)


# ----------------------------------------------------------------------------
# MLP.

def _gelu_exact(x):
  return nn.gelu(x, approximate=False)


# Names follow Hugging Face's `hidden_act` strings where they differ: 'gelu'
# is the exact erf form (GPT-NeoX), 'gelu_new' the tanh approximation.
ACTIVATIONS = {
    "silu": nn.silu,
    "gelu": _gelu_exact,
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
    "relu": nn.relu,
    "linear": lambda x: x,
}


class Mlp(nn.Module):
  """Product of activated input projections, then the output projection.

  ('silu', 'linear') is SwiGLU (wi_0 = gate, wi_1 = up, as t5x's gated MLP);
  a single activation gives the plain MLP with one input projection 'wi'.
  With `dropout_rate`, the hidden units are dropped (masks shared along
  length, as t5x) unless `deterministic`.
  """
  mlp_dim: int
  activations: Sequence[str]
  use_bias: bool = False
  dtype: Any = jnp.float32
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    """x [batch, length, embed] -> [batch, length, embed]."""
    for name in self.activations:
      checks.check_choice("Mlp", "activation", name, ACTIVATIONS)
    if self.has_variable("params", FUSED_WI):
      # The input projections stacked (`fuse_projections`).
      joined = DenseGeneral((len(self.activations), self.mlp_dim),
                            ("embed", None, "mlp"), use_bias=self.use_bias,
                            dtype=self.dtype, name=FUSED_WI)(x)
      projected = [joined[..., i, :] for i in range(len(self.activations))]
    else:
      projected = [
          DenseGeneral((self.mlp_dim,), ("embed", "mlp"),
                       use_bias=self.use_bias, dtype=self.dtype, name=name)(x)
          for name in self._input_names()]
    hidden = [ACTIVATIONS[name](h)
              for name, h in zip(self.activations, projected)]
    h = functools.reduce(operator.mul, hidden)
    if self.dropout_rate:
      h = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(
          h, deterministic=deterministic)
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    return DenseGeneral((x.shape[-1],), ("mlp", "embed"),
                        use_bias=self.use_bias, dtype=self.dtype,
                        name="wo")(h)

  def _input_names(self) -> Tuple[str, ...]:
    if len(self.activations) == 1:
      return ("wi",)
    return tuple(f"wi_{i}" for i in range(len(self.activations)))

  def param_fusions(self, method: str):
    """The projections `fuse_projections` may join
    (`recording_param_fusions`): the gated MLP's input projections."""
    if method != "__call__" or len(self.activations) == 1:
      return ()
    return (Fusion(FUSED_WI, self._input_names(), stack=True,
                   unsplit=("mlp",)),)


# ----------------------------------------------------------------------------
# Embedding and output layer.

class Embed(nn.Module):
  """Token embedding [vocab, embed]; `attend` uses it as a tied output layer."""
  num_embeddings: int
  features: int
  dtype: Any = jnp.float32
  # None: normal with std 1/sqrt(embed) (`default_embedding_init`).
  embedding_init: Optional[Callable] = None
  # The dtype of `attend`'s product (None: `dtype`); t5x computes tied
  # logits in float32.
  attend_dtype: Any = None

  def setup(self):
    self.embedding = self.param(
        "embedding", _boxed(self.embedding_init or default_embedding_init(),
                            ("vocab", "embed")),
        (self.num_embeddings, self.features), jnp.float32)

  def __call__(self, tokens: Array) -> Array:
    """tokens [batch, length] -> [batch, length, embed] in `dtype`."""
    return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)

  def attend(self, x: Array) -> Array:
    """x [batch, length, embed] -> logits [batch, length, vocab]."""
    dtype = self.attend_dtype or self.dtype
    return jnp.einsum("ble,ve->blv", x.astype(dtype),
                      self.embedding.astype(dtype))

  def param_read_dtypes(self, method: str):
    """{parameter: the dtype `method` casts it to at every read}
    (`recording_param_reads`)."""
    if method == "__call__":
      return {"embedding": self.dtype}
    if method == "attend":
      return {"embedding": self.attend_dtype or self.dtype}
    return {}


class OutputDense(nn.Module):
  """Untied output layer: kernel [embed, vocab], no bias."""
  vocab_size: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = self.param("kernel", _boxed(kernel_init(1, 1), ("embed", "vocab")),
                        (x.shape[-1], self.vocab_size), jnp.float32)
    return jnp.einsum("ble,ev->blv", x.astype(self.dtype),
                      kernel.astype(self.dtype))

  def param_read_dtypes(self, method: str):
    """{parameter: the dtype `method` casts it to at every read}
    (`recording_param_reads`)."""
    return {"kernel": self.dtype} if method == "__call__" else {}


# ----------------------------------------------------------------------------
# Parameters cast once: a loop that calls the model many times with the same
# float32 parameters (a decode loop) would otherwise cast every weight to the
# compute dtype at every call, reading 4 bytes and writing 2 per parameter on
# each step where the step itself needs only the 2-byte read. XLA cannot hoist
# those casts out of the loop when the layers are scanned (each reads its
# layer's slice inside the scan). Measured on an H100: 38% of a bfloat16
# Llama 3.2 1B-shaped decode step (experiments/results/gpu/sampling.txt).

def _recording(declaration: str, record: Callable[[Tuple[str, ...], Any],
                                                  None]):
  """Intercepts the model calls made inside it: for each call of a module
  that has the method `declaration`, record(the module's path in the
  parameter tree, declaration(the called method's name))."""
  def interceptor(next_fun, args, kwargs, context):
    declared = getattr(context.module, declaration, None)
    # (Flax intercepts the declaring method's own call too.)
    if declared is not None and context.method_name != declaration:
      record(tuple(context.module.path), declared(context.method_name))
    return next_fun(*args, **kwargs)
  return nn.intercept_methods(interceptor)


@contextlib.contextmanager
def recording_param_reads():
  """Records, for the model calls made inside it, the dtype each parameter
  is cast to where it is read: yields {path: set of dtypes}, the path being
  the parameter's keys in the "params" tree (a scanned stack's path names
  its stacked parameter once).

  Only modules that declare their reads (`param_read_dtypes(method)`:
  `DenseGeneral`, `OutputDense`, `Embed`) are recorded; every other
  parameter (norm scales read in float32, T5's relative-position table, ...)
  is absent, and `cast_read_params` leaves it as it is.
  """
  reads = {}

  def record(path, dtypes):
    for name, dtype in dtypes.items():
      reads.setdefault(path + (name,), set()).add(jnp.dtype(dtype))

  with _recording("param_read_dtypes", record):
    yield reads


def cast_read_params(params, reads):
  """`params` with each floating leaf that every recorded read casts to one
  narrower dtype cast to it now; the model computes exactly the same values
  from the result (the reads' casts then do nothing), and a loop over it
  reads the narrow copy. `reads`: from `recording_param_reads`.
  """
  def cast(path, leaf):
    dtypes = reads.get(tuple(getattr(k, "key", k) for k in path))
    if (dtypes is None or len(dtypes) != 1 or not hasattr(leaf, "dtype")
        or not jnp.issubdtype(leaf.dtype, jnp.floating)):
      return leaf
    (dtype,) = dtypes
    return leaf.astype(dtype) if dtype.itemsize < leaf.dtype.itemsize else leaf

  return jax.tree_util.tree_map_with_path(cast, params)


# ----------------------------------------------------------------------------
# Projections joined for a decode loop: a decode step multiplies one row per
# sequence by each weight matrix, so its products are bound by reading the
# weights, and the small ones (a layer's query, key and value) reach a lower
# share of the memory bandwidth than one product over their joined weights
# (experiments/results/gpu/decode_matmul.txt). Joined once per rollout, like
# the casts above, they are read joined at every step.

@dataclasses.dataclass(frozen=True)
class Fusion:
  """Sibling projections of one input that `fuse_projections` may join.

  members: the `DenseGeneral` submodules, in the order of their outputs in
    the joined one, `name`. Their parameters are concatenated along `axis`
    (the heads of the attention projections: -2 of a kernel [embed, heads,
    head_dim] and of a bias [heads, head_dim]; -1 of t5x's joined kernels
    [embed, heads * head_dim]) or, with `stack`, stacked along a new axis
    there (the gated MLP's equal projections: [embed, n, mlp]).
  unsplit: logical axes of the members that must not be split over the
    current mesh for the join to cost nothing: a plan may split the query
    heads and not the key/value heads, and a stacked MLP input split over
    a tensor-parallel axis took 30 MiB more per chip in the PPO T5-XL plan
    (v5e 4x8, model axis 8) than its cast parts. Tensor-parallel meshes
    keep their projections apart.
  """
  name: str
  members: Tuple[str, ...]
  axis: int = -2
  stack: bool = False
  unsplit: Tuple[str, ...] = ()


FUSED_QKV = Fusion("fused_qkv", ("query", "key", "value"),
                   unsplit=("heads", "kv_heads"))
FUSED_T5_QKV = Fusion("fused_qkv", ("query", "key", "value"), axis=-1,
                      unsplit=("joined_kv",))
# A gated MLP's joined input projections (their number is its activations').
FUSED_WI = "fused_wi"
# The parameters of a projection that can be joined: a member with any
# other (LoRA's factors) keeps its group separate.
_JOINABLE = frozenset({"kernel", "bias"})


@contextlib.contextmanager
def recording_param_fusions():
  """Records, for the model calls made inside it, the projections each
  module could have read joined: yields {module path: (Fusion, ...)} for
  the modules that declare them (`param_fusions(method)`: `Attention`,
  a gated `Mlp`), to give to `fuse_projections`."""
  fusions = {}

  def record(path, declared):
    if declared:
      fusions[path] = tuple(declared)

  with _recording("param_fusions", record):
    yield fusions


def _unsplit(axes: Sequence[str]) -> bool:
  """Whether the logical `axes` are each on mesh axes of size 1 (or no mesh)
  under the current mesh and logical-axis rules."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not axes:
    return True
  for spec in nn.logical_to_mesh_axes(tuple(axes)):
    spec = spec if isinstance(spec, tuple) else (spec,)
    if int(np.prod([mesh.shape[a] for a in spec if a is not None])) > 1:
      return False
  return True


def fuse_projections(params, fusions, cast_from=None):
  """`params` with each group of sibling projections recorded by
  `recording_param_fusions` joined into one (`Fusion`): the modules then
  compute each output from the joined weights with the same inputs and the
  same sums (rounded in another order, the products being others), and a
  loop over the result reads one weight per group. A group stays separate
  where a member is absent, holds more than a kernel and a bias (LoRA's
  factors), differs from the others in its parameters' dtypes or names, or
  where the current mesh splits an `unsplit` axis.

  cast_from: the parameters `params` were cast from (`cast_read_params`);
    then a group joins only where all its members' parameters were cast,
    so that the joined copy takes the place of the cast ones and a loop
    over the result holds no more memory than over `params` (parameters
    read in the dtype they are held in have no copy to replace).
  """
  def fuse(node, fusion, before):
    parts = [node.get(m) for m in fusion.members]
    if fusion.name in node or not all(hasattr(p, "keys") for p in parts):
      return node
    names = set(parts[0].keys())
    if not names <= _JOINABLE or any(set(p.keys()) != names for p in parts):
      return node
    # One array dtype per parameter name (a boxed leaf has none).
    dtypes = [{getattr(p[n], "dtype", None) for p in parts} for n in names]
    if any(len(d) != 1 or None in d for d in dtypes) or not _unsplit(
        fusion.unsplit):
      return node
    if cast_from is not None and (before is None or any(
        before[m][n].dtype == node[m][n].dtype for m in fusion.members
        for n in names)):
      return node
    def join(xs):
      if fusion.stack:
        xs = [jnp.expand_dims(x, fusion.axis) for x in xs]
      return jnp.concatenate(xs, axis=fusion.axis)
    joined = {n: join([p[n] for p in parts]) for n in sorted(names)}
    node = {k: v for k, v in node.items() if k not in fusion.members}
    node[fusion.name] = joined
    return node

  def at(tree, path):
    for key in path:
      if tree is None or not hasattr(tree, "keys") or key not in tree:
        return None
      tree = tree[key]
    return tree

  def replace_at(tree, path, fn):
    if not path:
      return fn(tree)
    if not hasattr(tree, "keys") or path[0] not in tree:
      return tree
    out = dict(tree)
    out[path[0]] = replace_at(tree[path[0]], path[1:], fn)
    return out

  for path, declared in fusions.items():
    before = at(cast_from, path) if cast_from is not None else None
    for fusion in declared:
      params = replace_at(params, path, functools.partial(
          fuse, fusion=fusion, before=before))
  return params


# ----------------------------------------------------------------------------
# The layer stack: scan over layers and rematerialisation.

def remat_policy(name: str):
  """The jax.checkpoint policy for a `remat_policy` config string."""
  checks.check_choice("layers", "remat_policy", name, REMAT_POLICIES)
  if name == "full":
    return None
  return getattr(jax.checkpoint_policies, name)


def make_layer_stack(block, config, num_layers: int, scan_layers: bool,
                     remat_policy_name: str, *, num_args: int = 3,
                     static_argnums: Sequence[int] = (),
                     layer_index: bool = False,
                     name: Optional[str] = None):
  """`num_layers` copies of `block(config)`.

  `block(config)` must be a module called as `block(x, *args)` with
  `num_args` further arguments (broadcast to every layer) and returning
  `(x, None)` (the scan carry signature). Returns a list of modules, or,
  when `scan_layers`, one `nn.scan`-ned module whose parameters (and KV
  cache) have a leading [num_layers] axis with logical name 'layers'.
  `stack_layer_params` / `unstack_layer_params` convert between the two
  layouts. Call it with `run_layer_stack`.

  Made inside `setup`, assign the result to `self.layers` (flax names the
  list's modules layers_0 ... layers_{n-1}, as t5x). Made inside an
  `nn.compact` method, pass `name="layers"` to get the same names.

  Args:
    static_argnums: positions (counting the block's `self` as 0) of
      arguments that are Python values, e.g. a `deterministic` flag; they
      are static for the rematerialised block.
    layer_index: the block takes its layer's index as one more argument
      after the `num_args` (for layers that differ, `LayerAttention`): a
      Python int unrolled, a traced int32 scalar scanned; `run_layer_stack`
      passes it when given the stack's `layer_count`.
  """
  if layer_index and not scan_layers:
    static_argnums = tuple(static_argnums) + (num_args + 2,)
  if remat_policy_name != "none":
    # Under scan, CSE across iterations cannot happen, so prevent_cse (which
    # blocks some XLA optimisations) is only needed unrolled.
    block = nn.remat(block, policy=remat_policy(remat_policy_name),
                     static_argnums=tuple(static_argnums),
                     prevent_cse=not scan_layers)
  named = {} if name is None else {"name": name}
  if scan_layers:
    scanned = nn.scan(
        block, variable_axes={"params": 0, "cache": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * num_args + ((0,) if layer_index else ()),
        length=num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"})
    return scanned(config, **named)
  if name is None:
    return [block(config) for _ in range(num_layers)]
  return [block(config, name=f"{name}_{i}") for i in range(num_layers)]


def run_layer_stack(layers, x: Array, *args,
                    layer_count: Optional[int] = None) -> Array:
  """Applies what `make_layer_stack` made; x [batch, length, embed]. With
  `layer_count` (a stack made with `layer_index`), each layer also gets its
  index."""
  if isinstance(layers, (list, tuple)):
    for i, layer in enumerate(layers):
      x, _ = layer(x, *args, *(() if layer_count is None else (i,)))
    return x
  if layer_count is not None:
    args += (jnp.arange(layer_count, dtype=jnp.int32),)
  x, _ = layers(x, *args)
  return x


def self_attention_segments(attention_mask: Array,
                            segment_ids: Optional[Array] = None,
                            max_segments: Optional[int] = None
                            ) -> CausalSegments:
  """The `CausalSegments` of a forward pass over whole sequences: the
  attention mask's real tokens as one segment, or packing's segment ids
  (`max_segments` examples at most per row)."""
  if segment_ids is None:
    real = jnp.minimum(jnp.asarray(attention_mask).astype(jnp.int32), 1)
    return CausalSegments(real)
  segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
  if segment_ids.shape != jnp.shape(attention_mask):
    raise ValueError(f"segment_ids has shape {segment_ids.shape}, the "
                     f"attention mask {jnp.shape(attention_mask)}.")
  return CausalSegments(
      segment_ids, None if max_segments is None else max_segments + 1)


def check_decoder_inputs(tokens, positions, attention_mask):
  """Shapes of the common decoder-only call, checked at trace time."""
  for name, arr in (("tokens", tokens), ("positions", positions),
                    ("attention_mask", attention_mask)):
    if arr.ndim != 2:
      raise ValueError(f"{name} must be [batch, length], got shape {arr.shape}.")
  if not tokens.shape == positions.shape == attention_mask.shape:
    raise ValueError(
        "tokens, positions and attention_mask must have one shape [batch, "
        f"length]; got {tokens.shape}, {positions.shape}, "
        f"{attention_mask.shape}.")


class DecoderOnly(nn.Module):
  """Token embedding -> layer stack -> final norm -> output logits.

  The parameter tree follows t5x's decoder-only layout: token_embedder/
  embedding, layers_i/... (or layers/... when scanned), decoder_norm/...,
  logits_dense/kernel (absent when the embedding is tied).

  `config` needs: vocab_size, emb_dim, num_layers, dtype, scan_layers,
  remat_policy, tie_embeddings.

  Options a family sets (`CausalLM.decoder_options`): `index_layers`, the
  block takes its layer's index as a last argument (layers that attend
  differently: `LayerAttention`); `embedding_multiplier`, applied to the
  embeddings (Gemma's sqrt(emb_dim)); `final_logit_softcap`, the output
  logits' soft cap (`softcap`).
  """
  config: Any
  block: Any
  final_norm: Callable[[], nn.Module]
  index_layers: bool = False
  embedding_multiplier: Optional[float] = None
  final_logit_softcap: Optional[float] = None

  def setup(self):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    self.token_embedder = Embed(cfg.vocab_size, cfg.emb_dim, dtype)
    self.layers = make_layer_stack(self.block, cfg, cfg.num_layers,
                                   cfg.scan_layers, cfg.remat_policy,
                                   num_args=3,  # positions, mask, cache_index
                                   layer_index=self.index_layers)
    self.decoder_norm = self.final_norm()
    if not cfg.tie_embeddings:
      self.logits_dense = OutputDense(cfg.vocab_size, dtype)

  def hidden_states(self, tokens: Array, positions: Array,
                    attention_mask: Array, segment_ids: Optional[Array] = None,
                    max_segments: Optional[int] = None) -> Array:
    """The normalised last-layer states [batch, length, embed] (compute dtype).

    Args:
      tokens: int [batch, length].
      positions: int [batch, length]; `positions_from_mask(attention_mask)`
        makes left- and right-padded rows agree; packed rows restart them
        at each example.
      attention_mask: [batch, length], 1 = real token, 0 = pad.
      segment_ids: packed rows: int [batch, length], 1, 2, ... per example
        (contiguous), 0 on padding; a token attends within its example.
      max_segments: with `segment_ids`, the static bound on a row's examples
        (the fused kernels' layouts need it).
    """
    check_decoder_inputs(tokens, positions, attention_mask)
    mask = self_attention_segments(attention_mask, segment_ids, max_segments)
    x = self.embed(tokens)
    x = run_layer_stack(self.layers, x, positions, mask, None,
                        layer_count=self._layer_count())
    x = self.decoder_norm(x)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))

  def _layer_count(self) -> Optional[int]:
    return self.config.num_layers if self.index_layers else None

  def embed(self, tokens: Array) -> Array:
    """tokens [batch, length] -> embeddings [batch, length, embed]."""
    x = self.token_embedder(tokens)
    if self.embedding_multiplier is not None:
      x = x * jnp.asarray(self.embedding_multiplier, x.dtype)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))

  def decode_step(self, tokens: Array, positions: Array,
                  attention_mask: Array, cache_index) -> Array:
    """Incremental decoding with the KV cache; apply with mutable=["cache"].

    The first call (prefill) passes the whole left-padded prompt at
    cache_index 0 and creates the cache of T = attention_mask.shape[-1]
    positions; each later call passes the newest token(s) and the returned
    cache.

    Args:
      tokens: int [batch, L], at cache positions cache_index ..
        cache_index + L - 1.
      positions: int [batch, L] rotary positions (for a left-padded prompt,
        `positions_from_mask`; a generated token's is one more than the
        previous token's).
      attention_mask: [batch, T] over the whole cache (a cache in chunks,
        `kv_cache_chunks`: over its first T positions, the end of a chunk):
        the prompt's mask, then 1 for every generated position.
      cache_index: int scalar (may be traced).
    Returns:
      float32 logits [batch, vocab] of the last of the L inputs.
    """
    length = tokens.shape[-1]
    if (self.config.attention_impl == "splash"
        and isinstance(cache_index, int) and cache_index == 0
        and length > 1):
      # A prefill through the fused kernel: the prompt's causal attention
      # over its own keys, the padding on the left its own segments.
      mask = CausalSegments(
          jnp.minimum(jnp.asarray(attention_mask)[:, :length], 1).astype(
              jnp.int32), cache_length=attention_mask.shape[-1])
    else:
      mask = cache_mask(attention_mask, cache_index, length)
    x = self.embed(tokens)
    x = run_layer_stack(self.layers, x, positions, mask, cache_index,
                        layer_count=self._layer_count())
    # Only the last position's logits are needed: a prefill of a long prompt
    # would otherwise build a [batch, L, vocab] array.
    x = self.decoder_norm(x[:, -1:])
    return self.logits_from_hidden(x)[:, 0]

  def logits_from_hidden(self, hidden: Array) -> Array:
    """[batch, length, embed] -> float32 logits [batch, length, vocab]."""
    if self.config.tie_embeddings:
      logits = self.token_embedder.attend(hidden)
    else:
      logits = self.logits_dense(hidden)
    logits = softcap(logits.astype(jnp.float32), self.final_logit_softcap)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

  def __call__(self, tokens: Array, positions: Array,
               attention_mask: Array, segment_ids: Optional[Array] = None,
               max_segments: Optional[int] = None) -> Array:
    """tokens, positions, attention_mask [batch, length] (and packed rows'
    segment_ids) -> float32 logits [batch, length, vocab]."""
    return self.logits_from_hidden(
        self.hidden_states(tokens, positions, attention_mask, segment_ids,
                           max_segments))


def _stack(*xs):
  # Host arrays stay on the host (an import of a large checkpoint must not
  # land on one device); device arrays are stacked where they live.
  if all(isinstance(x, np.ndarray) for x in xs):
    return np.stack(xs)
  return jnp.stack(xs)


def stack_layer_params(params, num_layers: int, stack_name: str = "decoder"):
  """Unrolled -> scanned layout: `stack/layers_i/...` to `stack/layers/...`.

  Args:
    params: the (unboxed) parameter dict of an unrolled model.
    num_layers: how many `layers_i` subtrees to stack.
    stack_name: the key in `params` of the subtree holding the layers.
  Returns:
    A new dict whose `stack/layers` leaves are [num_layers, ...] arrays.
  """
  params = dict(params)
  stack = dict(params[stack_name])
  names = [f"layers_{i}" for i in range(num_layers)]
  missing = [n for n in names if n not in stack]
  if missing or "layers" in stack or f"layers_{num_layers}" in stack:
    raise ValueError(
        f"'{stack_name}' must hold exactly layers_0..layers_{num_layers - 1} "
        f"to stack; it has {sorted(k for k in stack if k.startswith('layers'))}.")
  per_layer = [stack.pop(n) for n in names]
  stack["layers"] = jax.tree.map(_stack, *per_layer)
  params[stack_name] = stack
  return params


def unstack_layer_params(params, stack_name: str = "decoder"):
  """Scanned -> unrolled layout (inverse of `stack_layer_params`)."""
  params = dict(params)
  stack = dict(params[stack_name])
  stacked = stack.pop("layers")
  num_layers = jax.tree.leaves(stacked)[0].shape[0]
  for i in range(num_layers):
    stack[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
  params[stack_name] = stack
  return params


class CausalLM(nn.Module):
  """A decoder-only family: `DecoderOnly` under the scope 'decoder' (t5x
  layout) with the family's block and final norm.

  Subclasses set `block_cls` and define `final_norm()`, a factory of the
  final normalisation module, and may define `decoder_options()`, the
  `DecoderOnly` options of the family (layer indices, embedding multiplier,
  output soft cap).
  """
  config: Any
  block_cls = None

  def final_norm(self):
    raise NotImplementedError

  def decoder_options(self):
    return {}

  def setup(self):
    self.decoder = DecoderOnly(self.config, self.block_cls, self.final_norm(),
                               **self.decoder_options())

  def hidden_states(self, tokens: Array, positions: Array,
                    attention_mask: Array, segment_ids: Optional[Array] = None,
                    max_segments: Optional[int] = None) -> Array:
    """[batch, length] inputs -> final normalised states [batch, length,
    embed] in the compute dtype; packed rows also pass their segment_ids
    (`DecoderOnly.hidden_states`)."""
    return self.decoder.hidden_states(tokens, positions, attention_mask,
                                      segment_ids, max_segments)

  def logits_from_hidden(self, hidden: Array) -> Array:
    """[batch, length, embed] -> float32 logits [batch, length, vocab]."""
    return self.decoder.logits_from_hidden(hidden)

  def decode_step(self, tokens: Array, positions: Array,
                  attention_mask: Array, cache_index) -> Array:
    """One KV-cache step (see `DecoderOnly.decode_step`): float32 logits
    [batch, vocab] of the last of `tokens`; apply with mutable=["cache"]."""
    return self.decoder.decode_step(tokens, positions, attention_mask,
                                    cache_index)

  def __call__(self, tokens: Array, positions: Array,
               attention_mask: Array, segment_ids: Optional[Array] = None,
               max_segments: Optional[int] = None) -> Array:
    """tokens, positions, attention_mask [batch, length] (and packed rows'
    segment_ids) -> float32 logits [batch, length, vocab]."""
    return self.decoder(tokens, positions, attention_mask, segment_ids,
                        max_segments)
