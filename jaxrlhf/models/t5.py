"""T5 encoder-decoder in Flax Linen, with t5x's parameter layout.

The parameter tree, initialisers and numerics follow t5x's
`examples/t5/network.py` (T5 1.1 by default): pre-norm RMSNorm layers, one
relative-position bias table per stack shared by its layers, no attention
scaling (it is folded into the query initialisation), gated-GELU MLP, a
separate `logits_dense` output layer. T5 1.0 is the options `mlp_activations=
("relu",)` and `logits_via_embedding=True`. Checkpoints written by t5x load
into this tree unchanged (tests/fixtures/t5x holds checkpoints t5x wrote).

Every parameter carries logical axis names and every large activation a
logical constraint, so `jaxrlhf.sharding` maps the model onto any mesh.

Speed options (numerically the same model): `scan_layers` runs each stack
as one `nn.scan` over layers (parameters stacked under `encoder/layers` and
`decoder/layers`; `scan_layer_params` / `unscan_layer_params` convert from
and to the t5x layout that checkpoints hold), `attention_impl='dot_product'`
uses `jax.nn.dot_product_attention` with the relative-position and mask bias
as its `bias`, and `remat_policy` rematerialises layers.

Incremental decoding: `T5.decode_step` keeps a KV cache in the flax "cache"
collection (self-attention keys/values per decoder position, the encoder's
cross-attention keys/values projected once); the relative-position bias of a
new token uses its absolute decoder position. `jaxrlhf.models.sampling`
drives it.
"""

import dataclasses
import functools
import operator
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import layers as layers_lib

Array = jax.Array
# Masked attention logits get this additive bias (t5x's value), in the
# activation dtype.
_MASK_VALUE = -1e10
ATTENTION_IMPLS = ("xla", "dot_product")


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Hyper-parameters of a T5 model; the field names are t5x's T5Config's."""
  vocab_size: int = 32128
  emb_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  mlp_dim: int = 1024
  # ("gelu", "linear") is T5 1.1's gated GELU; ("relu",) is T5 1.0.
  mlp_activations: Sequence[str] = ("gelu", "linear")
  dropout_rate: float = 0.0
  # True ties the output layer to the token embedding (T5 1.0).
  logits_via_embedding: bool = False
  # Compute dtype; parameters stay float32.
  dtype: str = "float32"
  float32_attention_logits: bool = False
  relpos_num_buckets: int = 32
  relpos_max_distance: int = 128
  # Rematerialise each layer in the backward pass ("none", "full",
  # "dots_saveable"): trades compute for activation memory.
  remat_policy: str = "none"
  # nn.scan over each stack's layers: one compiled layer body and parameters
  # stacked under `encoder/layers` and `decoder/layers` with a leading
  # 'layers' axis. False keeps t5x's `layers_{i}` layout (what T5X
  # checkpoints hold); `scan_layer_params` / `unscan_layer_params` convert.
  scan_layers: bool = False
  # 'xla': einsums and softmax as t5x; 'dot_product':
  # jax.nn.dot_product_attention with the relative-position and mask bias
  # passed as `bias` (lets JAX pick a fused kernel). Same numbers.
  attention_impl: str = "xla"

  def __post_init__(self):
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"T5Config.attention_impl={self.attention_impl!r}; "
                       f"choose one of {list(ATTENTION_IMPLS)}.")
    if self.remat_policy != "none" and self.remat_policy not in _REMAT_POLICIES:
      raise ValueError(f"T5Config.remat_policy={self.remat_policy!r}; choose "
                       f"'none' or one of {sorted(_REMAT_POLICIES)}.")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


# T5 1.1 dimensions (t5x's t5_1_1 gin files); "tiny" is for tests and the
# built-in synthetic tasks.
T5_PRESETS = {
    "tiny": dict(emb_dim=64, num_heads=4, num_encoder_layers=2,
                 num_decoder_layers=2, head_dim=16, mlp_dim=128),
    "small": dict(emb_dim=512, num_heads=6, num_encoder_layers=8,
                  num_decoder_layers=8, head_dim=64, mlp_dim=1024),
    "base": dict(emb_dim=768, num_heads=12, num_encoder_layers=12,
                 num_decoder_layers=12, head_dim=64, mlp_dim=2048),
    "large": dict(emb_dim=1024, num_heads=16, num_encoder_layers=24,
                  num_decoder_layers=24, head_dim=64, mlp_dim=2816),
    "xl": dict(emb_dim=2048, num_heads=32, num_encoder_layers=24,
               num_decoder_layers=24, head_dim=64, mlp_dim=5120),
    "xxl": dict(emb_dim=4096, num_heads=64, num_encoder_layers=24,
                num_decoder_layers=24, head_dim=64, mlp_dim=10240),
}


def t5_config(size: str, **overrides) -> T5Config:
  """A T5Config from a preset name, with fields overridden."""
  if size not in T5_PRESETS:
    raise ValueError(
        f"Unknown T5 size {size!r}; choose one of {sorted(T5_PRESETS)}.")
  return T5Config(**{**T5_PRESETS[size], **overrides})


# t5x: truncated normal for MLP and output kernels, normal for attention.
_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
_attention_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


class RMSNorm(nn.Module):
  """x * rsqrt(mean(x^2) + eps) * scale, computed in float32."""
  dtype: Any = jnp.float32
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x):
    x = x.astype(jnp.float32)
    scale = self.param(
        "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        (x.shape[-1],), jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True)
                          + self.epsilon)
    return y.astype(self.dtype) * scale.astype(self.dtype)


class Dense(nn.Module):
  """x @ kernel over the last axis; the kernel is stored 2-D [in, out]."""
  features: int
  axes: tuple
  dtype: Any = jnp.float32
  kernel_init: Any = _kernel_init

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel",
                        nn.with_logical_partitioning(self.kernel_init, self.axes),
                        (x.shape[-1], self.features), jnp.float32)
    return jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))


class Embed(nn.Module):
  """Token embedding, optionally used transposed as the output layer."""
  num_embeddings: int
  features: int
  dtype: Any = jnp.float32

  def setup(self):
    self.embedding = self.param(
        "embedding",
        nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0),
                                     ("vocab", "embed")),
        (self.num_embeddings, self.features), jnp.float32)

  def __call__(self, tokens):
    return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)

  def attend(self, x):
    """Logits x @ embedding^T in float32 (as t5x's attend_dtype)."""
    return jnp.dot(x.astype(jnp.float32), self.embedding.T.astype(jnp.float32))


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


def attention_mask(query_valid, key_valid, causal=False):
  """[batch, 1, q, k] mask of allowed (query, key) pairs."""
  mask = query_valid[:, None, :, None] & key_valid[:, None, None, :]
  if causal:
    q, k = query_valid.shape[-1], key_valid.shape[-1]
    mask = mask & (np.arange(q)[:, None] >= np.arange(k)[None, :])
  return mask


class MultiHeadAttention(nn.Module):
  """Unscaled dot-product attention with t5x's 2-D projection kernels.

  KV cache (incremental decoding), in the flax "cache" collection (apply
  with `mutable=["cache"]`):
  - self-attention, `cache_index` given: the keys/values of `inputs_q` are
    written at positions [cache_index, cache_index + q_len) of
    `cached_key`/`cached_value` [batch, T, heads, head_dim] (T = the bias's
    key length; created as zeros on the first call) and the queries attend
    over all T positions, the bias masking the ones not yet written;
  - cross-attention, `cache_cross=True`: with `inputs_kv` the keys/values of
    the encoder output are computed and stored; with `inputs_kv=None` the
    stored ones are read (the encoder output is projected once per sample).
  """
  num_heads: int
  head_dim: int
  dtype: Any = jnp.float32
  float32_logits: bool = False
  dropout_rate: float = 0.0
  attention_impl: str = "xla"

  @nn.compact
  def __call__(self, inputs_q, inputs_kv, bias, deterministic=True, *,
               cache_index=None, cache_cross=False):
    """inputs [batch, length, embed], bias [batch|1, heads|1, q, k]."""
    features = self.num_heads * self.head_dim
    # 1/sqrt(head_dim) is folded into the query initialisation, not the logits.
    depth_scaling = np.sqrt(self.head_dim).astype(np.float32)
    query_init = lambda *a: _attention_init(*a) / depth_scaling
    project = functools.partial(Dense, features, ("embed", "joined_kv"),
                                dtype=self.dtype, kernel_init=_attention_init)
    batch, q_len = inputs_q.shape[0], inputs_q.shape[1]
    head_axes = ("batch", "length", "heads", "kv")
    query = project(kernel_init=query_init, name="query")(inputs_q)
    query = query.reshape(batch, q_len, self.num_heads, self.head_dim)
    query = nn.with_logical_constraint(query, head_axes)
    if cache_cross and inputs_kv is None:
      key = self.get_variable("cache", "cached_key")
      value = self.get_variable("cache", "cached_value")
      if key is None:
        raise ValueError(
            "Cross-attention cache is empty: the first decoding call must "
            "pass the encoder output so its keys and values are cached.")
    else:
      k_len = inputs_kv.shape[1]
      key = project(name="key")(inputs_kv)
      value = project(name="value")(inputs_kv)
      key = key.reshape(batch, k_len, self.num_heads, self.head_dim)
      value = value.reshape(batch, k_len, self.num_heads, self.head_dim)
      key = nn.with_logical_constraint(key, head_axes)
      value = nn.with_logical_constraint(value, head_axes)
      if cache_cross:
        for name, new in (("cached_key", key), ("cached_value", value)):
          self.variable("cache", name, lambda x: x, new).value = new
      elif cache_index is not None:
        key = layers_lib.update_kv_cache(self, "cached_key", key, cache_index,
                                         bias.shape[-1], head_axes)
        value = layers_lib.update_kv_cache(self, "cached_value", value,
                                           cache_index, bias.shape[-1],
                                           head_axes)
    use_dropout = not deterministic and self.dropout_rate > 0
    if self.attention_impl == "dot_product" and not use_dropout:
      # jax.nn.dot_product_attention has no attention-weight dropout; with
      # dropout active the einsum path below computes the same thing.
      dtype = jnp.float32 if self.float32_logits else query.dtype
      out = jax.nn.dot_product_attention(
          query.astype(dtype), key.astype(dtype), value.astype(dtype),
          bias=bias.astype(dtype), scale=1.0).astype(self.dtype)
    else:
      if self.float32_logits:
        query, key = query.astype(jnp.float32), key.astype(jnp.float32)
      logits = jnp.einsum("bqhd,bkhd->bhqk", query, key)
      logits = logits + bias.astype(logits.dtype)
      weights = jax.nn.softmax(logits).astype(self.dtype)
      if use_dropout:
        weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
      out = jnp.einsum("bhqk,bkhd->bqhd", weights, value)
    out = out.reshape(batch, q_len, features)
    out = nn.with_logical_constraint(out, ("batch", "length", "joined_kv"))
    return Dense(inputs_q.shape[-1], ("joined_kv", "embed"), dtype=self.dtype,
                 kernel_init=_attention_init, name="out")(out)


_ACTIVATIONS = {
    "gelu": nn.gelu,  # tanh approximation, as t5x
    "relu": nn.relu,
    "linear": lambda x: x,
    "silu": nn.silu,
}


class MlpBlock(nn.Module):
  """Product of activated input projections, then the output projection."""
  mlp_dim: int
  activations: Sequence[str]
  dtype: Any = jnp.float32
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x, deterministic=True):
    for name in self.activations:
      if name not in _ACTIVATIONS:
        raise ValueError(f"Unknown MLP activation {name!r}; "
                         f"choose from {sorted(_ACTIVATIONS)}.")
    hidden = []
    for i, name in enumerate(self.activations):
      dense_name = "wi" if len(self.activations) == 1 else f"wi_{i}"
      h = Dense(self.mlp_dim, ("embed", "mlp"), dtype=self.dtype,
                name=dense_name)(x)
      hidden.append(_ACTIVATIONS[name](h))
    h = functools.reduce(operator.mul, hidden)
    h = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(
        h, deterministic=deterministic)
    h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
    return Dense(x.shape[-1], ("mlp", "embed"), dtype=self.dtype, name="wo")(h)


def _residual_dropout(cfg, x, deterministic):
  return nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(
      x, deterministic=deterministic)


def _attention(cfg, name):
  return MultiHeadAttention(cfg.num_heads, cfg.head_dim, cfg.compute_dtype,
                            cfg.float32_attention_logits, cfg.dropout_rate,
                            cfg.attention_impl, name=name)


class EncoderLayer(nn.Module):
  """Returns (x, None): the carry signature of nn.scan."""
  config: T5Config

  @nn.compact
  def __call__(self, x, bias, deterministic=True):
    cfg = self.config
    h = RMSNorm(cfg.compute_dtype, name="pre_attention_layer_norm")(x)
    h = _attention(cfg, "attention")(h, h, bias, deterministic)
    x = x + _residual_dropout(cfg, h, deterministic)
    h = RMSNorm(cfg.compute_dtype, name="pre_mlp_layer_norm")(x)
    h = MlpBlock(cfg.mlp_dim, cfg.mlp_activations, cfg.compute_dtype,
                 cfg.dropout_rate, name="mlp")(h, deterministic)
    x = x + _residual_dropout(cfg, h, deterministic)
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


class DecoderLayer(nn.Module):
  """Returns (y, None): the carry signature of nn.scan.

  With `cache_index` (incremental decoding) self-attention reads and writes
  the KV cache, and cross-attention caches the encoder's keys and values on
  the call that passes `encoded` and reads them when `encoded` is None.
  """
  config: T5Config

  @nn.compact
  def __call__(self, y, encoded, self_bias, cross_bias, deterministic=True,
               cache_index=None):
    cfg = self.config
    cached = cache_index is not None
    h = RMSNorm(cfg.compute_dtype, name="pre_self_attention_layer_norm")(y)
    h = _attention(cfg, "self_attention")(h, h, self_bias, deterministic,
                                          cache_index=cache_index)
    y = y + _residual_dropout(cfg, h, deterministic)
    h = RMSNorm(cfg.compute_dtype, name="pre_cross_attention_layer_norm")(y)
    h = _attention(cfg, "encoder_decoder_attention")(
        h, encoded, cross_bias, deterministic, cache_cross=cached)
    y = y + _residual_dropout(cfg, h, deterministic)
    h = RMSNorm(cfg.compute_dtype, name="pre_mlp_layer_norm")(y)
    h = MlpBlock(cfg.mlp_dim, cfg.mlp_activations, cfg.compute_dtype,
                 cfg.dropout_rate, name="mlp")(h, deterministic)
    y = y + _residual_dropout(cfg, h, deterministic)
    return nn.with_logical_constraint(y, ("batch", "length", "embed")), None


_REMAT_POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


def maybe_remat(layer_cls, policy_name, deterministic_argnum,
                prevent_cse=True):
  if policy_name == "none":
    return layer_cls
  if policy_name not in _REMAT_POLICIES:
    raise ValueError(f"Unknown remat_policy {policy_name!r}; choose 'none' or "
                     f"one of {sorted(_REMAT_POLICIES)}.")
  # `deterministic` is a Python bool; argnums count `self` as 0.
  return nn.remat(layer_cls, policy=_REMAT_POLICIES[policy_name],
                  static_argnums=(deterministic_argnum,),
                  prevent_cse=prevent_cse)


def _layer_stack(cfg, layer_cls, num_layers, num_args, deterministic_argnum):
  """`num_layers` layers to call as `stack(x, *args) -> x`.

  Unscanned: modules `layers_0` ... (t5x's layout), called in a loop.
  Scanned: one nn.scan-ned module `layers` whose parameters (and KV cache)
  have a leading [num_layers] axis named 'layers'; the `num_args` arguments
  after the carry are broadcast to every layer.
  """
  # Under scan, CSE across iterations cannot happen, so prevent_cse (which
  # blocks some XLA optimisations) is only needed unrolled.
  layer_cls = maybe_remat(layer_cls, cfg.remat_policy, deterministic_argnum,
                          prevent_cse=not cfg.scan_layers)
  if cfg.scan_layers:
    scanned = nn.scan(
        layer_cls, variable_axes={"params": 0, "cache": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * num_args, length=num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"})(cfg, name="layers")
    return lambda x, *args: scanned(x, *args)[0]
  stack = [layer_cls(cfg, name=f"layers_{i}") for i in range(num_layers)]

  def run(x, *args):
    for layer in stack:
      x, _ = layer(x, *args)
    return x
  return run


def _mask_to_bias(mask, dtype):
  return jnp.where(mask, 0.0, _MASK_VALUE).astype(dtype)


class Encoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, tokens, deterministic=True):
    cfg = self.config
    length = tokens.shape[-1]
    bias = RelativePositionBias(cfg.num_heads, cfg.relpos_num_buckets,
                                cfg.relpos_max_distance, bidirectional=True,
                                dtype=cfg.compute_dtype, name="relpos_bias")(
                                    length, length)
    valid = tokens > 0
    bias = _mask_to_bias(attention_mask(valid, valid), cfg.compute_dtype) + bias
    x = self.shared_embedding(tokens)
    x = _residual_dropout(cfg, x, deterministic)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    layers = _layer_stack(cfg, EncoderLayer, cfg.num_encoder_layers, 2, 3)
    x = layers(x, bias, deterministic)
    x = RMSNorm(cfg.compute_dtype, name="encoder_norm")(x)
    return _residual_dropout(cfg, x, deterministic)


class Decoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoded, encoder_tokens, decoder_input_tokens,
               decoder_valid, deterministic=True, return_hidden=False,
               cache_index=None, cache_length=None):
    """Teacher-forced decoding, or with `cache_index` one incremental step.

    Incremental: `decoder_input_tokens` [batch, L] sit at positions
    cache_index .. cache_index + L - 1 of a KV cache of `cache_length`
    positions; every earlier position is a valid key (t5x's decode mode).
    """
    cfg = self.config
    length = decoder_input_tokens.shape[-1]
    relpos = RelativePositionBias(cfg.num_heads, cfg.relpos_num_buckets,
                                  cfg.relpos_max_distance, bidirectional=False,
                                  dtype=cfg.compute_dtype, name="relpos_bias")
    if cache_index is None:
      self_mask = attention_mask(decoder_valid, decoder_valid, causal=True)
      bias = relpos(length, length)
    else:
      if cache_length is None:
        raise ValueError("Incremental decoding needs cache_length (the number "
                         "of decoder positions the KV cache holds).")
      query_positions = cache_index + jnp.arange(length)
      causal = jnp.arange(cache_length)[None, :] <= query_positions[:, None]
      self_mask = decoder_valid[:, None, :, None] & causal[None, None]
      bias = relpos(length, cache_length, query_offset=cache_index)
    self_bias = _mask_to_bias(self_mask, cfg.compute_dtype) + bias
    cross_bias = _mask_to_bias(
        attention_mask(decoder_valid, encoder_tokens > 0), cfg.compute_dtype)
    y = self.shared_embedding(decoder_input_tokens)
    y = _residual_dropout(cfg, y, deterministic)
    y = nn.with_logical_constraint(y, ("batch", "length", "embed"))
    layers = _layer_stack(cfg, DecoderLayer, cfg.num_decoder_layers, 5, 5)
    y = layers(y, encoded, self_bias, cross_bias, deterministic, cache_index)
    y = RMSNorm(cfg.compute_dtype, name="decoder_norm")(y)
    y = _residual_dropout(cfg, y, deterministic)
    if return_hidden:
      return nn.with_logical_constraint(y, ("batch", "length", "embed"))
    if cfg.logits_via_embedding:
      logits = self.shared_embedding.attend(y) / np.sqrt(y.shape[-1])
    else:
      logits = Dense(cfg.vocab_size, ("embed", "vocab"), dtype=cfg.compute_dtype,
                     name="logits_dense")(y)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


class T5(nn.Module):
  """The encoder-decoder; `__call__` matches t5x's `Transformer.__call__`."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(cfg.vocab_size, cfg.emb_dim, cfg.compute_dtype)
    self.encoder = Encoder(cfg, self.token_embedder)
    self.decoder = Decoder(cfg, self.token_embedder)

  def encode(self, encoder_input_tokens, deterministic=True):
    """[batch, enc_len] tokens -> [batch, enc_len, emb_dim] encodings."""
    return self.encoder(encoder_input_tokens, deterministic)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens,
             decoder_target_tokens=None, deterministic=True,
             return_hidden=False):
    """Teacher-forced decoder logits [batch, dec_len, vocab].

    As in t5x, decoder self-attention masks padding from
    `decoder_target_tokens > 0`; without targets every position is valid
    (causality alone then keeps position t from seeing later ones). With
    `return_hidden` the final normalised states [batch, dec_len, emb_dim] are
    returned instead of logits (for reward and value heads).
    """
    if decoder_target_tokens is None:
      decoder_valid = jnp.ones(decoder_input_tokens.shape, bool)
    else:
      decoder_valid = decoder_target_tokens > 0
    return self.decoder(encoded, encoder_input_tokens, decoder_input_tokens,
                        decoder_valid, deterministic, return_hidden)

  def decode_step(self, encoded, encoder_input_tokens, decoder_input_tokens,
                  cache_index, cache_length: int):
    """Incremental decoding with the KV cache; apply with mutable=["cache"].

    The first call passes `encoded` (the encoder output [batch, enc_len,
    emb]); it creates the cache (self-attention keys/values for
    `cache_length` decoder positions, and the encoder's cross-attention
    keys/values, projected once). Later calls pass `encoded=None` and the
    returned cache:

      logits, v = model.apply({"params": p}, encoded, enc_tokens, bos, 0, T,
                              method=model.decode_step, mutable=["cache"])
      logits, v = model.apply({"params": p, "cache": v["cache"]}, None,
                              enc_tokens, next_tokens, 1, T,
                              method=model.decode_step, mutable=["cache"])

    Args:
      encoded: [batch, enc_len, emb_dim] on the first call, else None.
      encoder_input_tokens: [batch, enc_len] (its padding masks the keys).
      decoder_input_tokens: [batch, L] tokens at decoder positions
        cache_index .. cache_index + L - 1 (position 0 holds BOS = 0).
      cache_index: int scalar (may be traced).
      cache_length: static int, the decoder positions the cache holds.
    Returns:
      logits [batch, L, vocab] in the compute dtype.
    """
    valid = jnp.ones(decoder_input_tokens.shape, bool)
    return self.decoder(encoded, encoder_input_tokens, decoder_input_tokens,
                        valid, True, False, cache_index=cache_index,
                        cache_length=cache_length)

  def __call__(self, encoder_input_tokens, decoder_input_tokens,
               decoder_target_tokens=None, deterministic=True,
               return_hidden=False):
    encoded = self.encode(encoder_input_tokens, deterministic)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       decoder_target_tokens, deterministic, return_hidden)


# ----------------------------------------------------------------------------
# Parameter layouts: t5x's unscanned `layers_{i}` <-> scanned `layers`.

def scan_layer_params(params, config: T5Config):
  """t5x layout (`encoder/layers_i`, `decoder/layers_i`) -> the stacked
  layout of `scan_layers=True` (`encoder/layers`, `decoder/layers`, each leaf
  with a leading [num_layers] axis). Host numpy leaves stay on the host."""
  params = layers_lib.stack_layer_params(params, config.num_encoder_layers,
                                         "encoder")
  return layers_lib.stack_layer_params(params, config.num_decoder_layers,
                                       "decoder")


def unscan_layer_params(params):
  """Inverse of `scan_layer_params` (what T5X checkpoints and the HF export
  expect)."""
  params = layers_lib.unstack_layer_params(params, "encoder")
  return layers_lib.unstack_layer_params(params, "decoder")
