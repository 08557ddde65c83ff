"""t5x's decoder-only Transformer in Flax Linen, with its parameter layout.

The parameter tree is exactly that of t5x's
`examples/decoder_only/network.py` `DecoderWrapper`: every parameter lives
under the top-level scope `decoder/` (`decoder/token_embedder/embedding`,
`decoder/relpos_bias/rel_embedding`, `decoder/layers_{i}/...`,
`decoder/decoder_norm/scale`, and `decoder/logits_dense/kernel` when the
output layer is not tied). A t5x checkpoint read with
`jaxrlhf.models.t5x_checkpoint.read_t5x_checkpoint` loads unchanged:

  params = read_t5x_checkpoint(path)['params']        # {'decoder': {...}}
  model = T5xDecoderOnly(config)
  logits = model.apply({'params': params}, decoder_input_tokens,
                       decoder_target_tokens, method=model.t5x_logits)

and, with the decoder-only families' common signature (tokens, positions,
attention_mask), every algorithm trains it.

The numerics are t5x's (tests/fixtures/t5x/README.md lists them): pre-norm
RMSNorm layers with one self-attention and one MLP each, one unidirectional
relative-position bias table shared by all layers, unscaled dot-product
attention, masks as an additive -1e10, and, with `logits_via_embedding`,
logits = h @ embedding^T / sqrt(emb_dim) in float32. The building blocks are
the shared ones of `jaxrlhf.models.layers`, T5's among them.

The attention mask is t5x's `make_decoder_mask`: causal, AND padding taken
from `decoder_target_tokens > 0`, AND (with packing) equal segment ids; with
`decoder_causal_attention` (the prefix-LM mode, t5x's
`inputs_bidirectional_attention=True`) positions inside that prefix region also
see each other bidirectionally.

Besides the module, this file has the t5x `DecoderOnlyModel` computations:
`token_scores` / `score_batch`, and `greedy_continuation`, which reproduces
`predict_batch` with temperature 0 using the KV cache of `decode_step`.
"""

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import family
from jaxrlhf.models import sampling
from jaxrlhf.models import scoring
from jaxrlhf.models import t5
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import linears
from jaxrlhf.models.layers import normalizations
from jaxrlhf.models.layers import t5_attention

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class T5xDecoderOnlyConfig:
  """Hyper-parameters; field names are t5x's decoder_only TransformerConfig's.

  The defaults are t5x's, except `dropout_rate` (0.0 here, 0.1 there) and the
  fields t5x fixes in its network code (relative-position buckets and
  distance), which are configurable here with t5x's values as defaults.
  """
  vocab_size: int = 32128
  emb_dim: int = 512
  num_heads: int = 8
  num_layers: int = 6
  head_dim: int = 64
  mlp_dim: int = 2048
  # ("relu",) is t5x's default; ("gelu", "linear") the gated GELU of its gin
  # files.
  mlp_activations: Sequence[str] = ("relu",)
  dropout_rate: float = 0.0
  # True: the output layer is the token embedding transposed, scaled by
  # 1/sqrt(emb_dim); False: a separate `logits_dense` [emb, vocab].
  logits_via_embedding: bool = False
  # Compute dtype; parameters stay float32, logits are float32.
  dtype: str = "float32"
  float32_attention_logits: bool = False
  relpos_num_buckets: int = 32
  relpos_max_distance: int = 128
  # Rematerialise each layer in the backward pass ("none", "full",
  # "dots_saveable", "nothing_saveable").
  remat_policy: str = "none"

  def __post_init__(self):
    for name in ("vocab_size", "emb_dim", "num_heads", "num_layers",
                 "head_dim", "mlp_dim", "relpos_num_buckets",
                 "relpos_max_distance"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"T5xDecoderOnlyConfig.{name} must be a positive "
                         f"integer, got {value!r}.")
    if isinstance(self.mlp_activations, str):
      raise ValueError("T5xDecoderOnlyConfig.mlp_activations must be a "
                       f"sequence of names such as ('gelu', 'linear'), got the "
                       f"string {self.mlp_activations!r}.")
    try:
      jnp.dtype(self.dtype)
    except TypeError as e:
      raise ValueError(f"T5xDecoderOnlyConfig.dtype={self.dtype!r} is not a "
                       "dtype name (e.g. 'float32', 'bfloat16').") from e

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @classmethod
  def preset(cls, name: str, **overrides) -> "T5xDecoderOnlyConfig":
    """A size by name (see T5X_DECODER_ONLY_PRESETS), fields overridden."""
    return FAMILY.preset(name, **overrides)

  @classmethod
  def from_t5x(cls, transformer_config: Mapping[str, Any], **overrides):
    """From t5x's TransformerConfig fields (e.g. a gin file's or the fixture
    config.json's "TransformerConfig"), with fields overridden."""
    fields = dict(transformer_config)
    if "dtype" in fields:
      fields["dtype"] = jnp.dtype(fields["dtype"]).name
    if "mlp_activations" in fields:
      fields["mlp_activations"] = tuple(fields["mlp_activations"])
    unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"T5xDecoderOnlyConfig.from_t5x: unknown fields "
                       f"{sorted(unknown)}.")
    return cls(**{**fields, **overrides})


def _gin_size(emb_dim, num_heads, num_layers, mlp_dim):
  # t5x/examples/decoder_only/models/base.gin and the sizes that include it:
  # gated GELU, tied output layer, head_dim 64, 32128 vocabulary.
  return T5xDecoderOnlyConfig(
      vocab_size=32128, emb_dim=emb_dim, num_heads=num_heads,
      num_layers=num_layers, head_dim=64, mlp_dim=mlp_dim,
      mlp_activations=("gelu", "linear"), logits_via_embedding=True)


T5X_DECODER_ONLY_PRESETS = {
    # The dimensions of tests/fixtures/t5x/decoder_only.
    "tiny": T5xDecoderOnlyConfig(
        vocab_size=128, emb_dim=32, num_heads=4, num_layers=2, head_dim=8,
        mlp_dim=64, mlp_activations=("gelu", "linear"),
        logits_via_embedding=True),
    "base": _gin_size(768, 12, 12, 2048),
    "large": _gin_size(1024, 16, 24, 2816),
    "xl": _gin_size(2048, 32, 24, 5120),
    "xxl": _gin_size(4096, 64, 24, 10240),
}


def make_decoder_mask(decoder_target_tokens: Array,
                      decoder_causal_attention: Optional[Array] = None,
                      decoder_segment_ids: Optional[Array] = None) -> Array:
  """t5x's decoder self-attention mask, as booleans.

  mask[b, 0, q, k] = (k <= q  OR  (prefix[b, q] AND prefix[b, k]))
                     AND valid[b, q] AND valid[b, k]
                     [AND segment[b, q] == segment[b, k]]
  with valid = decoder_target_tokens > 0 and prefix = decoder_causal_attention
  > 0. A padded query row is all False; t5x keeps it and its attention is
  then uniform (see the fixture README), which `T5xDecoderOnly` reproduces.

  Args:
    decoder_target_tokens: [batch, length] int; 0 marks padding.
    decoder_causal_attention: optional [batch, length], 1 on the prefix
      (prompt) region that attends bidirectionally. Despite t5x's name, 1
      means bidirectional.
    decoder_segment_ids: optional [batch, length] packing segment ids.
  Returns:
    [batch, 1, length, length] bool.
  """
  valid = decoder_target_tokens > 0
  mask = t5_attention.pairwise_mask(valid, valid, causal=True)
  if decoder_causal_attention is not None:
    prefix = (decoder_causal_attention > 0) & valid
    mask = mask | t5_attention.pairwise_mask(prefix, prefix)
  if decoder_segment_ids is not None:
    mask = mask & (decoder_segment_ids[:, None, :, None]
                   == decoder_segment_ids[:, None, None, :])
  return mask


class DecoderLayer(nn.Module):
  """Pre-norm self-attention then MLP, each with a residual connection;
  returns (x, None) (the layer stacks' carry signature)."""
  config: T5xDecoderOnlyConfig

  @nn.compact
  def __call__(self, x, self_attention_bias, deterministic=True,
               cache_index=None):
    """x [batch, length, embed]; bias [batch|1, heads, length, length], or
    [.., length, T] over a KV cache of T positions with `cache_index`."""
    cfg = self.config
    h = normalizations.RMSNorm(1e-6, cfg.compute_dtype,
                               name="pre_self_attention_layer_norm")(x)
    h = t5_attention.T5Attention(
        cfg.num_heads, cfg.head_dim, cfg.compute_dtype,
        cfg.float32_attention_logits, cfg.dropout_rate, self_attention=True,
        name="self_attention")(h, h, self_attention_bias, deterministic,
                               cache_index=cache_index)
    x = x + _dropout(cfg, h, deterministic)
    h = normalizations.RMSNorm(1e-6, cfg.compute_dtype,
                               name="pre_mlp_layer_norm")(x)
    h = linears.Mlp(cfg.mlp_dim,
                    linears.t5_mlp_activations(cfg.mlp_activations),
                    dtype=cfg.compute_dtype, dropout_rate=cfg.dropout_rate,
                    name="mlp")(h, deterministic)
    x = x + _dropout(cfg, h, deterministic)
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


def _dropout(cfg, x, deterministic):
  # t5x broadcasts its residual dropout masks along length.
  return nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(
      x, deterministic=deterministic)


class Decoder(nn.Module):
  """The `decoder/` scope: embedding, relpos table, layers, norm, logits."""
  config: T5xDecoderOnlyConfig

  def setup(self):
    cfg = self.config
    self.token_embedder = linears.Embed(
        cfg.vocab_size, cfg.emb_dim, cfg.compute_dtype,
        embedding_init=nn.initializers.normal(stddev=1.0),
        attend_dtype=jnp.float32)
    self.relpos_bias = t5_attention.RelativePositionBias(
        cfg.num_heads, cfg.relpos_num_buckets, cfg.relpos_max_distance,
        bidirectional=False, dtype=cfg.compute_dtype)
    # `deterministic` is argument 3 counting `self`; a list attribute names
    # its modules layers_0, layers_1, ... (t5x's names).
    self.layers = decoders.make_layer_stack(
        DecoderLayer, cfg, cfg.num_layers, False, cfg.remat_policy,
        num_args=3, static_argnums=(3,))
    self.decoder_norm = normalizations.RMSNorm(1e-6, cfg.compute_dtype)
    self.input_dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    self.output_dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    if not cfg.logits_via_embedding:
      # float32 output layer, as t5x ("for stability").
      self.logits_dense = linears.DenseGeneral((cfg.vocab_size,),
                                               ("embed", "vocab"),
                                               dtype=jnp.float32)

  def hidden_states(self, decoder_input_tokens, decoder_target_tokens=None,
                    *, decoder_causal_attention=None, decoder_segment_ids=None,
                    deterministic=True):
    """[batch, length] features -> final states [batch, length, embed]."""
    cfg = self.config
    decoder_input_tokens = jnp.asarray(decoder_input_tokens)
    _check_tokens(decoder_input_tokens, "decoder_input_tokens")
    if decoder_target_tokens is None:
      decoder_target_tokens = jnp.ones_like(decoder_input_tokens)
    decoder_target_tokens = jnp.asarray(decoder_target_tokens)
    for name, value in (("decoder_target_tokens", decoder_target_tokens),
                        ("decoder_causal_attention", decoder_causal_attention),
                        ("decoder_segment_ids", decoder_segment_ids)):
      if value is not None and value.shape != decoder_input_tokens.shape:
        raise ValueError(
            f"{name} has shape {value.shape} but decoder_input_tokens has "
            f"{decoder_input_tokens.shape}; every feature is [batch, length].")
    length = decoder_input_tokens.shape[-1]
    mask = make_decoder_mask(decoder_target_tokens, decoder_causal_attention,
                             decoder_segment_ids)
    bias = (t5_attention.mask_to_bias(mask, cfg.compute_dtype)
            + self.relpos_bias(length, length))
    y = self.token_embedder(decoder_input_tokens.astype(jnp.int32))
    y = self.input_dropout(y, deterministic=deterministic)
    y = nn.with_logical_constraint(y, ("batch", "length", "embed"))
    y = decoders.run_layer_stack(self.layers, y, bias, deterministic, None)
    y = self.decoder_norm(y)
    return self.output_dropout(y, deterministic=deterministic)

  def decode_step(self, tokens, positions, attention_mask, cache_index,
                  bidirectional_prompt=False):
    """One KV-cache step; see `T5xDecoderOnly.decode_step`."""
    del positions  # relative positions come from cache positions
    cfg = self.config
    _check_tokens(tokens, "tokens")
    length = tokens.shape[-1]
    cache_length = attention_mask.shape[-1]
    real = jnp.asarray(attention_mask).astype(bool)
    query_slots = cache_index + jnp.arange(length)
    key_slots = jnp.arange(cache_length)
    real_queries = jax.lax.dynamic_slice_in_dim(real, cache_index, length,
                                                axis=1)
    causal = key_slots[None, :] <= query_slots[:, None]
    # t5x's mask: real query AND real key AND causal (a pad query row is all
    # masked, its attention uniform, as in `make_decoder_mask`).
    mask = (real_queries[:, None, :, None] & real[:, None, None, :]
            & causal[None, None])
    if bidirectional_prompt:
      # Prefix-LM prefill: the inputs of this call see each other both ways.
      among_inputs = ((key_slots >= cache_index)
                      & (key_slots < cache_index + length))
      mask = mask | (real_queries[:, None, :, None] & real[:, None, None, :]
                     & among_inputs[None, None, None, :])
    bias = (t5_attention.mask_to_bias(mask, cfg.compute_dtype)
            + self.relpos_bias(length, cache_length, query_offset=cache_index))
    y = self.token_embedder(tokens.astype(jnp.int32))
    y = nn.with_logical_constraint(y, ("batch", "length", "embed"))
    y = decoders.run_layer_stack(self.layers, y, bias, True, cache_index)
    y = self.decoder_norm(y[:, -1:])
    return self.logits_from_hidden(y)[:, 0]

  def logits_from_hidden(self, hidden):
    """[batch, length, embed] -> float32 logits [batch, length, vocab]."""
    cfg = self.config
    if cfg.logits_via_embedding:
      # attend() is float32; the 1/sqrt(emb_dim) keeps tied logits O(1).
      logits = self.token_embedder.attend(hidden) / np.sqrt(hidden.shape[-1])
    else:
      logits = self.logits_dense(hidden)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

  def __call__(self, decoder_input_tokens, decoder_target_tokens=None, *,
               decoder_causal_attention=None, decoder_segment_ids=None,
               deterministic=True):
    hidden = self.hidden_states(
        decoder_input_tokens, decoder_target_tokens,
        decoder_causal_attention=decoder_causal_attention,
        decoder_segment_ids=decoder_segment_ids, deterministic=deterministic)
    return self.logits_from_hidden(hidden)


def _check_tokens(tokens, name):
  if tokens.ndim != 2:
    raise ValueError(f"{name} must be [batch, length], got shape "
                     f"{tokens.shape}.")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{name} must hold integer token ids, got dtype "
                     f"{tokens.dtype}.")


class T5xDecoderOnly(nn.Module):
  """t5x's `DecoderWrapper`: the decoder under an outer `decoder/` scope.

  It has the decoder-only families' common signature (`decoders.CausalLM`),
  so every algorithm trains it:

    logits = model.apply({'params': p}, tokens, positions, attention_mask)

  with int [batch, length] tokens, attention_mask 1 = real token (its
  padding is t5x's `decoder_target_tokens > 0`) and `positions` ignored
  (relative positions come from array indices). t5x's own feature names are
  `t5x_logits` / `t5x_hidden_states`:

    logits = model.apply({'params': p}, decoder_input_tokens,
                         decoder_target_tokens, method=model.t5x_logits)

  which also take `decoder_causal_attention` (the prefix-LM mask),
  `decoder_segment_ids` (packing) and `deterministic` (dropout). t5x's
  `decoder_positions` is not taken: its network ignores it.
  """
  config: T5xDecoderOnlyConfig

  def setup(self):
    self.decoder = Decoder(self.config)

  def hidden_states(self, tokens, positions, attention_mask,
                    segment_ids=None, max_segments=None):
    """Final normalised states [batch, length, embed] (for value/reward
    heads) of the common signature; packed rows pass their segment_ids
    (t5x's `decoder_segment_ids`)."""
    del positions, max_segments
    return self.decoder.hidden_states(tokens, attention_mask,
                                      decoder_segment_ids=segment_ids)

  def logits_from_hidden(self, hidden):
    """[batch, length, embed] -> float32 logits [batch, length, vocab]."""
    return self.decoder.logits_from_hidden(hidden)

  def t5x_hidden_states(self, decoder_input_tokens,
                        decoder_target_tokens=None, **kwargs):
    """Final states from t5x's features (see the class docstring)."""
    return self.decoder.hidden_states(decoder_input_tokens,
                                      decoder_target_tokens, **kwargs)

  def t5x_logits(self, decoder_input_tokens, decoder_target_tokens=None,
                 **kwargs):
    """float32 logits [batch, length, vocab] from t5x's features."""
    return self.decoder(decoder_input_tokens, decoder_target_tokens,
                        **kwargs)

  def decode_step(self, tokens, positions, attention_mask, cache_index,
                  bidirectional_prompt=False):
    """Incremental decoding with the KV cache; apply with mutable=["cache"].

    The decoder-only families' common signature (see
    `decoders.DecoderOnly.decode_step`): the first call passes a left-padded
    prompt at cache_index 0 and creates a cache of T =
    attention_mask.shape[-1] positions; later calls pass the newest token.
    Relative positions are differences of cache positions, which left
    padding does not change, so a left-padded prompt decodes as t5x's
    right-padded one. `positions` is accepted for the common signature and
    ignored.

    Args:
      tokens: int [batch, L] at cache positions cache_index ..
        cache_index + L - 1 (t5x's BOS 0 is a real token here: the mask, not
        the id, says what is padding).
      positions: ignored.
      attention_mask: [batch, T], 1 = real (prompt, BOS, generated).
      cache_index: int scalar (may be traced).
      bidirectional_prompt: the L inputs attend to each other both ways (t5x's
        prefix-LM prefill, `inputs_bidirectional_attention=True`).
    Returns:
      float32 logits [batch, vocab] of the last of the L inputs.
    """
    return self.decoder.decode_step(tokens, positions, attention_mask,
                                    cache_index, bidirectional_prompt)

  def __call__(self, tokens, positions, attention_mask, segment_ids=None,
               max_segments=None):
    """tokens, positions, attention_mask [batch, length] (and packed rows'
    segment_ids) -> float32 logits [batch, length, vocab] (the common
    decoder-only signature)."""
    del positions, max_segments
    return self.decoder(tokens, attention_mask,
                        decoder_segment_ids=segment_ids)


# ----------------------------------------------------------------------------
# t5x DecoderOnlyModel computations.


def _causal_attention_or_none(batch, inputs_bidirectional_attention):
  """t5x ignores decoder_causal_attention unless the prefix-LM mode is on."""
  if not inputs_bidirectional_attention:
    return None
  if "decoder_causal_attention" not in batch:
    raise ValueError("inputs_bidirectional_attention=True needs the batch "
                     "feature 'decoder_causal_attention' (seqio's "
                     "PrefixLMFeatureConverter makes it).")
  return batch["decoder_causal_attention"]


def token_scores(model: T5xDecoderOnly, params, batch: Mapping[str, Array],
                 inputs_bidirectional_attention: bool = False) -> Array:
  """Per-token log p(target) times the loss weight, as t5x's score_batch.

  Args:
    model: the module.
    params: its parameters (the tree under 'params').
    batch: 'decoder_input_tokens', 'decoder_target_tokens',
      'decoder_loss_weights' [batch, length], optionally
      'decoder_causal_attention' and 'decoder_segment_ids'.
    inputs_bidirectional_attention: t5x's DecoderOnlyModel flag: use the
      prefix-LM mask from 'decoder_causal_attention'.
  Returns:
    [batch, length] float32; 0 where the loss weight is 0.
  """
  logits = model.apply(
      {"params": params}, batch["decoder_input_tokens"],
      batch["decoder_target_tokens"],
      decoder_causal_attention=_causal_attention_or_none(
          batch, inputs_bidirectional_attention),
      decoder_segment_ids=batch.get("decoder_segment_ids"),
      method=model.t5x_logits)
  logprobs = scoring.token_logprobs(logits, batch["decoder_target_tokens"])
  return logprobs * batch["decoder_loss_weights"].astype(jnp.float32)


def score_batch(model: T5xDecoderOnly, params, batch: Mapping[str, Array],
                inputs_bidirectional_attention: bool = False) -> Array:
  """[batch] sequence log-likelihood over weighted (target) tokens, EOS
  included; t5x's `DecoderOnlyModel.score_batch` (z-loss not used)."""
  return jnp.sum(token_scores(model, params, batch,
                              inputs_bidirectional_attention), axis=-1)


def left_padded_prompts(decoder_input_tokens: Array,
                        decoder_causal_attention: Array):
  """t5x's right-padded decoder-only prompts as left-padded ones.

  t5x's prompt is `decoder_input_tokens * decoder_causal_attention`: BOS 0 at
  position 0, the P prompt tokens (non-zero), then zeros. The left-padded
  row holds the same P + 1 tokens (BOS included, marked real by the mask) at
  its right end, which is what `sampling.sample_decoder_only` takes.
  Relative-position attention only sees position differences, so it gives
  the same numbers.

  Args:
    decoder_input_tokens, decoder_causal_attention: [batch, length].
  Returns:
    (prompt_tokens [batch, length] int32, prompt_attention_mask [batch,
    length] int32, prompt_length [batch]: P, BOS not counted).
  """
  prompt = (decoder_input_tokens
            * decoder_causal_attention.astype(decoder_input_tokens.dtype)
            ).astype(jnp.int32)
  length = prompt.shape[-1]
  prompt_length = jnp.sum(prompt[:, 1:] != 0, axis=-1)
  # Left-padded column j holds original position j - shift.
  shift = length - 1 - prompt_length
  source = jnp.arange(length)[None, :] - shift[:, None]
  real = source >= 0
  tokens = jnp.take_along_axis(prompt, jnp.maximum(source, 0), axis=1)
  return (jnp.where(real, tokens, 0).astype(jnp.int32),
          real.astype(jnp.int32), prompt_length)


def greedy_continuation(model: T5xDecoderOnly, params,
                        decoder_input_tokens: Array,
                        decoder_causal_attention: Array,
                        inputs_bidirectional_attention: bool = False,
                        eos_id: int = 1):
  """Argmax decoding from prompts, as t5x's DecoderOnlyModel.predict_batch.

  The prompt is `decoder_input_tokens * decoder_causal_attention`: BOS 0 at
  position 0, then the prompt tokens, then zeros. Its length P counts the
  non-zero tokens after position 0 (so prompt tokens must not be 0), and up to
  length - P tokens are generated. As in t5x's `temperature_sample`, an EOS
  already inside the prompt does not stop decoding; the first generated EOS is
  kept and everything after it is 0. Only the continuation is returned,
  starting at index 0 (t5x's `remove_prefix`).

  The prompts are left-padded (`left_padded_prompts`) and decoded with the KV
  cache (`sampling.sample_decoder_only`: one prefill pass, in which the prompt
  attends bidirectionally in the prefix-LM mode, then one causal step per
  token, as t5x's prefill-then-decode), and each row is cut to its budget
  length - P.

  Args:
    decoder_input_tokens: [batch, length] int, shifted right with 0 first.
    decoder_causal_attention: [batch, length], 1 on the first P + 1 positions.
    inputs_bidirectional_attention: prefix-LM mask over the prompt.
    eos_id: the end-of-sequence id.
  Returns:
    (tokens [batch, length] int32, finished [batch] bool: an EOS was made).
  """
  _check_tokens(decoder_input_tokens, "decoder_input_tokens")
  return _greedy_continuation_cached(model, params, decoder_input_tokens,
                                     decoder_causal_attention,
                                     inputs_bidirectional_attention, eos_id)


def _greedy_continuation_cached(model, params, decoder_input_tokens,
                                decoder_causal_attention,
                                inputs_bidirectional_attention, eos_id):
  length = decoder_input_tokens.shape[-1]
  tokens, mask, prompt_length = left_padded_prompts(
      jnp.asarray(decoder_input_tokens), jnp.asarray(decoder_causal_attention))
  samples = sampling.sample_decoder_only(
      model, params, tokens, mask, jax.random.PRNGKey(0), length, greedy=True,
      eos_id=eos_id, bidirectional_prompt=inputs_bidirectional_attention)
  # Row b may generate length - P_b tokens (t5x's per-row budget).
  within_budget = (jnp.arange(length)[None, :]
                   < (length - prompt_length)[:, None])
  out = jnp.where(within_budget, samples.tokens, 0)
  return out, jnp.any(out == eos_id, axis=-1)


def from_run_config(model_cfg, vocab_size: int) -> T5xDecoderOnlyConfig:
  """`config.model` (arch 't5x_decoder_only') -> T5xDecoderOnlyConfig."""
  family.refuse_fields(model_cfg, "t5x_decoder_only", {
      "scan_layers": (False, "has no scanned layout (t5x's decoder-only "
                      "checkpoints are unscanned)."),
      "attention_impl": ("xla", "only has the 'xla' attention."),
      "num_kv_heads": (None, "has one key/value head per query head.")})
  overrides = family.decoder_only_overrides(model_cfg, vocab_size)
  for field in ("scan_layers", "attention_impl"):
    overrides.pop(field, None)
  overrides.update(
      mlp_activations=t5.mlp_activations(model_cfg),
      logits_via_embedding=model_cfg.get("logits_via_embedding", False),
      dropout_rate=model_cfg.get("dropout_rate", 0.0))
  return family.with_family_fields(FAMILY.preset(model_cfg.size, **overrides),
                                   model_cfg)


FAMILY = family.Family(
    name="t5x_decoder_only",
    summary="t5x's decoder-only Transformer (relative-position bias, t5x "
    "parameter layout); T5X checkpoints.",
    config_cls=T5xDecoderOnlyConfig, module_cls=T5xDecoderOnly,
    kind=family.DECODER_ONLY, presets=T5X_DECODER_ONLY_PRESETS,
    from_run_config=from_run_config,
    layer_stacks=lambda c: (("decoder", c.num_layers),), t5x=True,
    attention_impls=("xla",))
