"""T5 encoder-decoder in Flax Linen, with t5x's parameter layout.

The parameter tree, initialisers and numerics follow t5x's
`examples/t5/network.py` (T5 1.1 by default): pre-norm RMSNorm layers, one
relative-position bias table per stack shared by its layers, no attention
scaling (it is folded into the query initialisation), gated-GELU MLP, a
separate `logits_dense` output layer. T5 1.0 is the options `mlp_activations=
("relu",)` and `logits_via_embedding=True`. Checkpoints written by t5x load
into this tree unchanged (tests/fixtures/t5x holds checkpoints t5x wrote).

It is built from the shared blocks of `jaxrlhf.models.layers` (RMSNorm,
DenseGeneral, Embed, Mlp, the layer stack, and the T5-style relative-position
attention it shares with t5x's decoder-only model). Every parameter carries
logical axis names and every large activation a logical constraint, so
`jaxrlhf.sharding` maps the model onto any mesh.

Speed options (numerically the same model): `scan_layers` runs each stack
as one `nn.scan` over layers (parameters stacked under `encoder/layers` and
`decoder/layers`; `scan_layer_params` / `unscan_layer_params` convert from
and to the t5x layout that checkpoints hold), `attention_impl='dot_product'`
uses `jax.nn.dot_product_attention` with the relative-position and mask bias
as its `bias`, and `remat_policy` rematerialises layers.

Packing (t5x's packed layout): `encoder_segment_ids` and
`decoder_segment_ids` confine every attention to one example of a packed
row; the relative-position bias is unchanged, an example's tokens being
contiguous.

Incremental decoding: `T5.decode_step` keeps a KV cache in the flax "cache"
collection (self-attention keys/values per decoder position, the encoder's
cross-attention keys/values projected once); the relative-position bias of a
new token uses its absolute decoder position. `jaxrlhf.models.sampling`
drives it.
"""

import dataclasses
import functools
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jaxrlhf import checks
from jaxrlhf.models import family
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import linears
from jaxrlhf.models.layers import normalizations
from jaxrlhf.models.layers import t5_attention

# T5's attention adds a learned relative-position bias to every logit;
# the fused kernels of the decoder-only families take no such bias.
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
  # With logits_via_embedding: divide the logits by sqrt(emb_dim) (t5x and
  # T5 1.0). False is the tied T5 1.1 that transformers 5 makes (it ties
  # every T5's output layer; `scale_decoder_outputs` false).
  scale_tied_logits: bool = True
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
    if self.attention_impl in ("splash", "dot_product_cudnn"):
      raise ValueError(
          f"T5Config.attention_impl={self.attention_impl!r}: T5 adds a "
          "learned relative-position bias to every attention logit, and "
          "neither splash attention nor cuDNN's flash path takes an "
          "arbitrary bias; use 'dot_product' (jax.nn.dot_product_attention "
          "with the bias) or 'xla'.")
    checks.check_choice("T5Config", "attention_impl",
                        self.attention_impl, ATTENTION_IMPLS)
    checks.check_choice("T5Config", "remat_policy",
                        self.remat_policy, decoders.REMAT_POLICIES)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


# T5 1.1 dimensions (t5x's t5_1_1 gin files); "tiny" is for tests and the
# built-in synthetic tasks.
T5_PRESETS = {
    "tiny": T5Config(emb_dim=64, num_heads=4, num_encoder_layers=2,
                     num_decoder_layers=2, head_dim=16, mlp_dim=128),
    "small": T5Config(emb_dim=512, num_heads=6, num_encoder_layers=8,
                      num_decoder_layers=8, head_dim=64, mlp_dim=1024),
    "base": T5Config(emb_dim=768, num_heads=12, num_encoder_layers=12,
                     num_decoder_layers=12, head_dim=64, mlp_dim=2048),
    "large": T5Config(emb_dim=1024, num_heads=16, num_encoder_layers=24,
                      num_decoder_layers=24, head_dim=64, mlp_dim=2816),
    "xl": T5Config(emb_dim=2048, num_heads=32, num_encoder_layers=24,
                   num_decoder_layers=24, head_dim=64, mlp_dim=5120),
    "xxl": T5Config(emb_dim=4096, num_heads=64, num_encoder_layers=24,
                    num_decoder_layers=24, head_dim=64, mlp_dim=10240),
}


def t5_config(size: str, **overrides) -> T5Config:
  """A T5Config from a preset name, with fields overridden."""
  return FAMILY.preset(size, **overrides)


def _attention(cfg, name, self_attention=False):
  return t5_attention.T5Attention(
      cfg.num_heads, cfg.head_dim, cfg.compute_dtype,
      cfg.float32_attention_logits, cfg.dropout_rate, cfg.attention_impl,
      self_attention, name=name)


def _norm(cfg, name):
  return normalizations.RMSNorm(1e-6, cfg.compute_dtype, name=name)


def _mlp(cfg):
  return linears.Mlp(cfg.mlp_dim,
                     linears.t5_mlp_activations(cfg.mlp_activations),
                     dtype=cfg.compute_dtype, dropout_rate=cfg.dropout_rate,
                     name="mlp")


def _residual_dropout(cfg, x, deterministic):
  # t5x broadcasts its residual dropout masks along length.
  return nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(
      x, deterministic=deterministic)


class EncoderLayer(nn.Module):
  """Returns (x, None): the carry signature of nn.scan."""
  config: T5Config

  @nn.compact
  def __call__(self, x, bias, deterministic=True):
    cfg = self.config
    h = _norm(cfg, "pre_attention_layer_norm")(x)
    h = _attention(cfg, "attention", True)(h, h, bias, deterministic)
    x = x + _residual_dropout(cfg, h, deterministic)
    h = _norm(cfg, "pre_mlp_layer_norm")(x)
    h = _mlp(cfg)(h, deterministic)
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
    h = _norm(cfg, "pre_self_attention_layer_norm")(y)
    h = _attention(cfg, "self_attention", True)(
        h, h, self_bias, deterministic, cache_index=cache_index)
    y = y + _residual_dropout(cfg, h, deterministic)
    h = _norm(cfg, "pre_cross_attention_layer_norm")(y)
    h = _attention(cfg, "encoder_decoder_attention")(
        h, encoded, cross_bias, deterministic, cache_cross=cached)
    y = y + _residual_dropout(cfg, h, deterministic)
    h = _norm(cfg, "pre_mlp_layer_norm")(y)
    h = _mlp(cfg)(h, deterministic)
    y = y + _residual_dropout(cfg, h, deterministic)
    return nn.with_logical_constraint(y, ("batch", "length", "embed")), None


def _layer_stack(cfg, layer_cls, num_layers, num_args, deterministic_argnum):
  """The stack's layers, called as `run(x, *args) -> x` (t5x's unscanned
  `layers_{i}` names, or one scanned `layers`; `layers.make_layer_stack`)."""
  stack = decoders.make_layer_stack(
      layer_cls, cfg, num_layers, cfg.scan_layers, cfg.remat_policy,
      num_args=num_args, static_argnums=(deterministic_argnum,),
      name="layers")
  return functools.partial(decoders.run_layer_stack, stack)


def _embedding(cfg):
  # t5x: N(0, 1) embeddings; tied logits are computed in float32.
  return linears.Embed(cfg.vocab_size, cfg.emb_dim, cfg.compute_dtype,
                       embedding_init=nn.initializers.normal(stddev=1.0),
                       attend_dtype=jnp.float32)


def same_segment(mask, query_segment_ids, key_segment_ids):
  """`mask` [batch, 1, q, k] AND query and key in one packed example (t5x's
  packing: `encoder_segment_ids`, `decoder_segment_ids`); `mask` itself
  without segment ids. The relative-position bias needs nothing more: a
  packed example's tokens are contiguous, so their offsets are its own."""
  if query_segment_ids is None:
    return mask
  return mask & (query_segment_ids[:, None, :, None]
                 == key_segment_ids[:, None, None, :])


class Encoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, tokens, deterministic=True, segment_ids=None):
    cfg = self.config
    length = tokens.shape[-1]
    bias = t5_attention.RelativePositionBias(
        cfg.num_heads, cfg.relpos_num_buckets, cfg.relpos_max_distance,
        bidirectional=True, dtype=cfg.compute_dtype, name="relpos_bias")(
            length, length)
    valid = tokens > 0
    mask = same_segment(t5_attention.pairwise_mask(valid, valid), segment_ids,
                        segment_ids)
    bias = t5_attention.mask_to_bias(mask, cfg.compute_dtype) + bias
    x = self.shared_embedding(tokens)
    x = _residual_dropout(cfg, x, deterministic)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    layers = _layer_stack(cfg, EncoderLayer, cfg.num_encoder_layers, 2, 3)
    x = layers(x, bias, deterministic)
    x = _norm(cfg, "encoder_norm")(x)
    return _residual_dropout(cfg, x, deterministic)


class Decoder(nn.Module):
  config: T5Config
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoded, encoder_tokens, decoder_input_tokens,
               decoder_valid, deterministic=True, return_hidden=False,
               cache_index=None, cache_length=None,
               encoder_segment_ids=None, decoder_segment_ids=None):
    """Teacher-forced decoding, or with `cache_index` one incremental step.

    Incremental: `decoder_input_tokens` [batch, L] sit at positions
    cache_index .. cache_index + L - 1 of a KV cache of `cache_length`
    positions; every earlier position is a valid key (t5x's decode mode).
    Packed rows (teacher-forced) pass both segment ids: a decoder token
    attends to its own example's decoder tokens and encoder tokens.
    """
    cfg = self.config
    length = decoder_input_tokens.shape[-1]
    relpos = t5_attention.RelativePositionBias(
        cfg.num_heads, cfg.relpos_num_buckets, cfg.relpos_max_distance,
        bidirectional=False, dtype=cfg.compute_dtype, name="relpos_bias")
    if (encoder_segment_ids is None) != (decoder_segment_ids is None):
      raise ValueError("Packed T5 rows need both encoder_segment_ids and "
                       "decoder_segment_ids.")
    if cache_index is None:
      self_mask = same_segment(
          t5_attention.pairwise_mask(decoder_valid, decoder_valid,
                                     causal=True),
          decoder_segment_ids, decoder_segment_ids)
      bias = relpos(length, length)
    else:
      if cache_length is None:
        raise ValueError("Incremental decoding needs cache_length (the number "
                         "of decoder positions the KV cache holds).")
      query_positions = cache_index + jnp.arange(length)
      causal = jnp.arange(cache_length)[None, :] <= query_positions[:, None]
      self_mask = decoder_valid[:, None, :, None] & causal[None, None]
      bias = relpos(length, cache_length, query_offset=cache_index)
    self_bias = t5_attention.mask_to_bias(self_mask, cfg.compute_dtype) + bias
    cross_bias = t5_attention.mask_to_bias(
        same_segment(t5_attention.pairwise_mask(decoder_valid,
                                                encoder_tokens > 0),
                     decoder_segment_ids, encoder_segment_ids),
        cfg.compute_dtype)
    y = self.shared_embedding(decoder_input_tokens)
    y = _residual_dropout(cfg, y, deterministic)
    y = nn.with_logical_constraint(y, ("batch", "length", "embed"))
    layers = _layer_stack(cfg, DecoderLayer, cfg.num_decoder_layers, 5, 5)
    y = layers(y, encoded, self_bias, cross_bias, deterministic, cache_index)
    y = _norm(cfg, "decoder_norm")(y)
    y = _residual_dropout(cfg, y, deterministic)
    if return_hidden:
      return nn.with_logical_constraint(y, ("batch", "length", "embed"))
    if cfg.logits_via_embedding:
      logits = self.shared_embedding.attend(y)
      if cfg.scale_tied_logits:
        logits = logits / np.sqrt(y.shape[-1])
    else:
      logits = linears.DenseGeneral(
          (cfg.vocab_size,), ("embed", "vocab"), dtype=cfg.compute_dtype,
          name="logits_dense")(y)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


class T5(nn.Module):
  """The encoder-decoder; `__call__` matches t5x's `Transformer.__call__`."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.token_embedder = _embedding(cfg)
    self.encoder = Encoder(cfg, self.token_embedder)
    self.decoder = Decoder(cfg, self.token_embedder)

  def encode(self, encoder_input_tokens, deterministic=True,
             encoder_segment_ids=None):
    """[batch, enc_len] tokens -> [batch, enc_len, emb_dim] encodings; packed
    rows pass their segment ids (a token attends within its example)."""
    return self.encoder(encoder_input_tokens, deterministic,
                        encoder_segment_ids)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens,
             decoder_target_tokens=None, deterministic=True,
             return_hidden=False, encoder_segment_ids=None,
             decoder_segment_ids=None):
    """Teacher-forced decoder logits [batch, dec_len, vocab].

    As in t5x, decoder self-attention masks padding from
    `decoder_target_tokens > 0`; without targets every position is valid
    (causality alone then keeps position t from seeing later ones). With
    `return_hidden` the final normalised states [batch, dec_len, emb_dim] are
    returned instead of logits (for reward and value heads). Packed rows
    pass both segment ids (t5x's packed layout; their decoder inputs start
    each example with BOS).
    """
    if decoder_target_tokens is None:
      decoder_valid = jnp.ones(decoder_input_tokens.shape, bool)
    else:
      decoder_valid = decoder_target_tokens > 0
    return self.decoder(encoded, encoder_input_tokens, decoder_input_tokens,
                        decoder_valid, deterministic, return_hidden,
                        encoder_segment_ids=encoder_segment_ids,
                        decoder_segment_ids=decoder_segment_ids)

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
               return_hidden=False, encoder_segment_ids=None,
               decoder_segment_ids=None):
    encoded = self.encode(encoder_input_tokens, deterministic,
                          encoder_segment_ids)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       decoder_target_tokens, deterministic, return_hidden,
                       encoder_segment_ids, decoder_segment_ids)


# ----------------------------------------------------------------------------
# Parameter layouts: t5x's unscanned `layers_{i}` <-> scanned `layers`.

def scan_layer_params(params, config: T5Config):
  """t5x layout (`encoder/layers_i`, `decoder/layers_i`) -> the stacked
  layout of `scan_layers=True` (`encoder/layers`, `decoder/layers`, each leaf
  with a leading [num_layers] axis). Host numpy leaves stay on the host."""
  params = decoders.stack_layer_params(params, config.num_encoder_layers,
                                       "encoder")
  return decoders.stack_layer_params(params, config.num_decoder_layers,
                                     "decoder")


def unscan_layer_params(params):
  """Inverse of `scan_layer_params` (what T5X checkpoints and the HF export
  expect)."""
  params = decoders.unstack_layer_params(params, "encoder")
  return decoders.unstack_layer_params(params, "decoder")


# ----------------------------------------------------------------------------
# config.model -> T5Config.

# config.model.mlp -> mlp_activations (t5x's names: 'gelu' is the tanh
# approximation); T5 and t5x's decoder-only model read it.
MLP_ACTIVATIONS = {"gated-gelu": ("gelu", "linear"), "relu": ("relu",)}
# config.model fields -> T5Config fields.
_RUN_FIELDS = {f: f for f in ("emb_dim", "num_heads", "num_encoder_layers",
                              "num_decoder_layers", "head_dim", "mlp_dim",
                              "logits_via_embedding", "dropout_rate")
               + family.SPEED_FIELDS}


def mlp_activations(model_cfg):
  """`config.model.mlp` as mlp_activations."""
  mlp = model_cfg.get("mlp", "gated-gelu")
  if mlp not in MLP_ACTIVATIONS:
    raise ValueError(f"config.model.mlp: {mlp!r}; choose one of "
                     f"{sorted(MLP_ACTIVATIONS)}.")
  return MLP_ACTIVATIONS[mlp]


def from_run_config(model_cfg, vocab_size: int) -> T5Config:
  """`config.model` (arch 't5') -> T5Config."""
  family.refuse_fields(model_cfg, "t5", {
      "num_kv_heads": (None, "has one key/value head per query head.")})
  return family.with_family_fields(
      t5_config(model_cfg.size, vocab_size=vocab_size,
                mlp_activations=mlp_activations(model_cfg),
                **family.set_fields(model_cfg, _RUN_FIELDS)), model_cfg)


# ----------------------------------------------------------------------------
# Hugging Face's T5ForConditionalGeneration.

HF_ARCHITECTURE = "T5ForConditionalGeneration"
_unsupported = functools.partial(family.unsupported, HF_ARCHITECTURE)
# HF `feed_forward_proj` <-> t5x `mlp_activations`. Plain "gelu" is left
# out on purpose: HF's is the exact erf GELU, t5x's the tanh approximation.
HF_ACTIVATIONS = {
    "relu": ("relu",),
    "gated-gelu": ("gelu", "linear"),
    "gated-relu": ("relu", "linear"),
    "gated-silu": ("silu", "linear"),
}
_RELPOS = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def _scales_logits(hf) -> bool:
  # 4.x: tie_word_embeddings (default true) both ties and scales by
  # d_model**-0.5; 5.x always ties and keeps the scaling switch separately.
  if "scale_decoder_outputs" in hf:
    return bool(hf["scale_decoder_outputs"])
  return bool(family.hf_get(hf, "tie_word_embeddings", True))


def config_from_hf(hf) -> T5Config:
  """The config.json's model, the output layer as its switches say; the
  file's tensors then decide whether it is tied (`reconcile`)."""
  get = functools.partial(family.hf_get, hf)
  proj = get("feed_forward_proj", "relu")
  if proj not in HF_ACTIVATIONS:
    _unsupported(f"feed_forward_proj={proj!r} (choose from "
                 f"{sorted(HF_ACTIVATIONS)})")
  eps = float(get("layer_norm_epsilon", 1e-6))
  if eps != 1e-6:
    _unsupported(f"layer_norm_epsilon={eps} (t5x fixes 1e-6)")
  num_layers = get("num_layers")
  scaled = _scales_logits(hf)
  return T5Config(
      vocab_size=get("vocab_size"), emb_dim=get("d_model"),
      num_heads=get("num_heads"), num_encoder_layers=num_layers,
      num_decoder_layers=get("num_decoder_layers", num_layers),
      head_dim=get("d_kv"), mlp_dim=get("d_ff"),
      mlp_activations=HF_ACTIVATIONS[proj],
      # A scaled model is t5x's tied T5 1.0; an unscaled one is tied only
      # if its file has no separate output matrix (`reconcile`).
      logits_via_embedding=scaled,
      relpos_num_buckets=get("relative_attention_num_buckets", 32),
      relpos_max_distance=get("relative_attention_max_distance", 128),
      dtype="float32")


def config_to_hf(config: T5Config):
  activations = tuple(config.mlp_activations)
  proj = {v: k for k, v in HF_ACTIVATIONS.items()}.get(activations)
  if proj is None:
    raise family.HFCheckpointError(
        f"T5 mlp_activations={activations} has no HF feed_forward_proj; "
        f"exportable: {sorted(HF_ACTIVATIONS.values())}.")
  scaled = bool(config.logits_via_embedding and config.scale_tied_logits)
  return {
      "architectures": [HF_ARCHITECTURE], "model_type": "t5",
      "vocab_size": config.vocab_size, "d_model": config.emb_dim,
      "d_kv": config.head_dim, "d_ff": config.mlp_dim,
      "num_layers": config.num_encoder_layers,
      "num_decoder_layers": config.num_decoder_layers,
      "num_heads": config.num_heads,
      "relative_attention_num_buckets": config.relpos_num_buckets,
      "relative_attention_max_distance": config.relpos_max_distance,
      "feed_forward_proj": proj, "layer_norm_epsilon": 1e-6,
      "dropout_rate": 0.0, "is_encoder_decoder": True,
      # 5.x reads the logit scaling from scale_decoder_outputs and ties
      # when the file has no lm_head; 4.x reads both from
      # tie_word_embeddings, so it cannot express a tied unscaled T5 1.1
      # (the file transformers 5 writes for one is what this writes).
      "tie_word_embeddings": bool(config.logits_via_embedding),
      "scale_decoder_outputs": scaled,
      "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
  }


def reconcile(config, tensors):
  """The output layer as the file holds it:

  - no lm_head.weight, or one equal to the embedding: tied (a transformers
    5 save of T5 1.1 writes none: it ties every T5);
  - a scaled config (T5 1.0) whose file has a different lm_head: the
    scale is folded into that head (t5x has no scaled separate head, but
    h * d**-0.5 @ W == h @ (W * d**-0.5));
  - otherwise a separate `logits_dense`.
  """
  head = tensors.get("lm_head.weight")
  shared = tensors.get("shared.weight")
  if shared is None and "encoder.embed_tokens.weight" in tensors:
    # Some exports keep only the encoder's copy of the shared embedding.
    shared = tensors["encoder.embed_tokens.weight"]
    tensors = dict(tensors, **{"shared.weight": shared})
  scaled = config.logits_via_embedding  # as `config_from_hf` read it
  tied = head is None or (shared is not None and np.array_equal(head, shared))
  if tied:
    tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    return dataclasses.replace(config, logits_via_embedding=True,
                               scale_tied_logits=scaled), tensors
  if scaled:
    scale = np.float32(config.emb_dim ** -0.5)
    tensors = dict(tensors, **{"lm_head.weight": head * scale})
  return dataclasses.replace(config, logits_via_embedding=False), tensors


def _mlp_names(cfg):
  count = len(tuple(cfg.mlp_activations))
  return ["wi"] if count == 1 else [f"wi_{i}" for i in range(count)]


def tensor_shapes(cfg, tensors):
  """HF names and shapes. HF keeps one relative-position table per stack, in
  block 0's self-attention, as [buckets, heads]."""
  del tensors
  d, inner, f = cfg.emb_dim, cfg.num_heads * cfg.head_dim, cfg.mlp_dim
  shapes = {"shared.weight": (cfg.vocab_size, d),
            "encoder.final_layer_norm.weight": (d,),
            "decoder.final_layer_norm.weight": (d,),
            "encoder." + _RELPOS: (cfg.relpos_num_buckets, cfg.num_heads),
            "decoder." + _RELPOS: (cfg.relpos_num_buckets, cfg.num_heads)}
  if not cfg.logits_via_embedding:
    shapes["lm_head.weight"] = (cfg.vocab_size, d)

  def attention(prefix):
    return {prefix + "q.weight": (inner, d), prefix + "k.weight": (inner, d),
            prefix + "v.weight": (inner, d), prefix + "o.weight": (d, inner)}

  def mlp(prefix):
    out = {prefix + f"{name}.weight": (f, d) for name in _mlp_names(cfg)}
    out[prefix + "wo.weight"] = (d, f)
    return out

  for i in range(cfg.num_encoder_layers):
    p = f"encoder.block.{i}.layer."
    shapes.update(attention(p + "0.SelfAttention."))
    shapes.update(mlp(p + "1.DenseReluDense."))
    shapes[p + "0.layer_norm.weight"] = (d,)
    shapes[p + "1.layer_norm.weight"] = (d,)
  for i in range(cfg.num_decoder_layers):
    p = f"decoder.block.{i}.layer."
    shapes.update(attention(p + "0.SelfAttention."))
    shapes.update(attention(p + "1.EncDecAttention."))
    shapes.update(mlp(p + "2.DenseReluDense."))
    for j in range(3):
      shapes[p + f"{j}.layer_norm.weight"] = (d,)
  return shapes


_HF_ATTENTION = {"query": "q", "key": "k", "value": "v", "out": "o"}


def from_hf(cfg, t):
  """t5x layout; attention kernels stay 2-D [in, out] (joined heads)."""
  linear = family.torch_linear

  def attention(prefix):
    return {ours: {"kernel": linear(t[prefix + f"{hf}.weight"])}
            for ours, hf in _HF_ATTENTION.items()}

  def mlp(prefix):
    out = {name: {"kernel": linear(t[prefix + f"{name}.weight"])}
           for name in _mlp_names(cfg)}
    out["wo"] = {"kernel": linear(t[prefix + "wo.weight"])}
    return out

  encoder = {
      "relpos_bias": {"rel_embedding": linear(t["encoder." + _RELPOS])},
      "encoder_norm": {"scale": t["encoder.final_layer_norm.weight"]}}
  for i in range(cfg.num_encoder_layers):
    p = f"encoder.block.{i}.layer."
    encoder[f"layers_{i}"] = {
        "pre_attention_layer_norm": {"scale": t[p + "0.layer_norm.weight"]},
        "attention": attention(p + "0.SelfAttention."),
        "pre_mlp_layer_norm": {"scale": t[p + "1.layer_norm.weight"]},
        "mlp": mlp(p + "1.DenseReluDense."),
    }
  decoder = {
      "relpos_bias": {"rel_embedding": linear(t["decoder." + _RELPOS])},
      "decoder_norm": {"scale": t["decoder.final_layer_norm.weight"]}}
  for i in range(cfg.num_decoder_layers):
    p = f"decoder.block.{i}.layer."
    decoder[f"layers_{i}"] = {
        "pre_self_attention_layer_norm": {
            "scale": t[p + "0.layer_norm.weight"]},
        "self_attention": attention(p + "0.SelfAttention."),
        "pre_cross_attention_layer_norm": {
            "scale": t[p + "1.layer_norm.weight"]},
        "encoder_decoder_attention": attention(p + "1.EncDecAttention."),
        "pre_mlp_layer_norm": {"scale": t[p + "2.layer_norm.weight"]},
        "mlp": mlp(p + "2.DenseReluDense."),
    }
  if not cfg.logits_via_embedding:
    decoder["logits_dense"] = {"kernel": linear(t["lm_head.weight"])}
  return {"token_embedder": {"embedding": t["shared.weight"]},
          "encoder": encoder, "decoder": decoder}


def to_hf(cfg, params):
  enc, dec, linear = params["encoder"], params["decoder"], family.torch_linear

  def attention(prefix, p):
    return {prefix + f"{hf}.weight": linear(p[ours]["kernel"])
            for ours, hf in _HF_ATTENTION.items()}

  def mlp(prefix, p):
    out = {prefix + f"{name}.weight": linear(p[name]["kernel"])
           for name in _mlp_names(cfg)}
    out[prefix + "wo.weight"] = linear(p["wo"]["kernel"])
    return out

  shared = params["token_embedder"]["embedding"]
  t = {"shared.weight": shared,
       "encoder.final_layer_norm.weight": enc["encoder_norm"]["scale"],
       "decoder.final_layer_norm.weight": dec["decoder_norm"]["scale"],
       "encoder." + _RELPOS: linear(enc["relpos_bias"]["rel_embedding"]),
       "decoder." + _RELPOS: linear(dec["relpos_bias"]["rel_embedding"])}
  if not cfg.logits_via_embedding:
    t["lm_head.weight"] = linear(dec["logits_dense"]["kernel"])
  for i in range(cfg.num_encoder_layers):
    p, layer = f"encoder.block.{i}.layer.", enc[f"layers_{i}"]
    t.update(attention(p + "0.SelfAttention.", layer["attention"]))
    t.update(mlp(p + "1.DenseReluDense.", layer["mlp"]))
    t[p + "0.layer_norm.weight"] = layer["pre_attention_layer_norm"]["scale"]
    t[p + "1.layer_norm.weight"] = layer["pre_mlp_layer_norm"]["scale"]
  for i in range(cfg.num_decoder_layers):
    p, layer = f"decoder.block.{i}.layer.", dec[f"layers_{i}"]
    t.update(attention(p + "0.SelfAttention.", layer["self_attention"]))
    t.update(attention(p + "1.EncDecAttention.",
                       layer["encoder_decoder_attention"]))
    t.update(mlp(p + "2.DenseReluDense.", layer["mlp"]))
    t[p + "0.layer_norm.weight"] = layer["pre_self_attention_layer_norm"][
        "scale"]
    t[p + "1.layer_norm.weight"] = layer["pre_cross_attention_layer_norm"][
        "scale"]
    t[p + "2.layer_norm.weight"] = layer["pre_mlp_layer_norm"]["scale"]
  return t


FAMILY = family.Family(
    name="t5",
    summary="T5 encoder-decoder with t5x's parameter layout (T5 1.1 gated "
    "GELU, T5 1.0 ReLU with tied embeddings); T5X checkpoints and HF "
    "T5ForConditionalGeneration.",
    config_cls=T5Config, module_cls=T5, kind=family.ENCODER_DECODER,
    presets=T5_PRESETS, from_run_config=from_run_config,
    layer_stacks=lambda c: (("encoder", c.num_encoder_layers),
                            ("decoder", c.num_decoder_layers)),
    t5x=True, attention_impls=ATTENTION_IMPLS,
    hf=family.HFMapping(
        architecture=HF_ARCHITECTURE, model_type="t5",
        config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        tensor_shapes=tensor_shapes, from_hf=from_hf, to_hf=to_hf,
        reconcile=reconcile,
        ignored=(r"(encoder|decoder)\.embed_tokens\.weight",
                 r"decoder\.block\.0\.layer\.1\.EncDecAttention\."
                 r"relative_attention_bias\.weight")))
