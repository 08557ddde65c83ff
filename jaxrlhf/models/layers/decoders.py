"""The layer stack (scanned or unrolled, rematerialised) and the
decoder-only model built on it (`DecoderOnly`, `CausalLM`).

Llama-style and GPT-NeoX-style transformers differ only in which blocks
they use and how they wire them: RMSNorm vs LayerNorm, full vs partial
rotary embeddings, gated (SwiGLU) vs plain GELU MLPs, biases or none,
sequential vs parallel residual. A family writes its block from this
package's layers and subclasses `CausalLM` with it.
"""

from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import checks
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import kv_cache
from jaxrlhf.models.layers import linears
from jaxrlhf.models.layers import moe

Array = jax.Array


# 'none' keeps every activation; 'full' recomputes the whole layer in the
# backward pass; the rest are jax.checkpoint_policies names.
REMAT_POLICIES = ("none", "full", "dots_saveable",
                  "dots_with_no_batch_dims_saveable", "nothing_saveable",
                  "everything_saveable")


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
    # "intermediates": what a layer sows (MoE router logits) stacked per
    # layer, as the parameters; without it scan would drop them. "routing":
    # the experts a MoE layer replays (`layers.moe.ROUTING`), per layer.
    scanned = nn.scan(
        block, variable_axes={"params": 0, "cache": 0, moe.INTERMEDIATES: 0,
                              moe.ROUTING: 0},
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
                            ) -> attentions.CausalSegments:
  """The `CausalSegments` of a forward pass over whole sequences: the
  attention mask's real tokens as one segment, or packing's segment ids
  (`max_segments` examples at most per row)."""
  if segment_ids is None:
    real = jnp.minimum(jnp.asarray(attention_mask).astype(jnp.int32), 1)
    return attentions.CausalSegments(real)
  segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
  if segment_ids.shape != jnp.shape(attention_mask):
    raise ValueError(f"segment_ids has shape {segment_ids.shape}, the "
                     f"attention mask {jnp.shape(attention_mask)}.")
  return attentions.CausalSegments(
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
    self.token_embedder = linears.Embed(cfg.vocab_size, cfg.emb_dim, dtype)
    self.layers = make_layer_stack(self.block, cfg, cfg.num_layers,
                                   cfg.scan_layers, cfg.remat_policy,
                                   num_args=3,  # positions, mask, cache_index
                                   layer_index=self.index_layers)
    self.decoder_norm = self.final_norm()
    if not cfg.tie_embeddings:
      self.logits_dense = linears.OutputDense(cfg.vocab_size, dtype)

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
      mask = attentions.CausalSegments(
          jnp.minimum(jnp.asarray(attention_mask)[:, :length], 1).astype(
              jnp.int32), cache_length=attention_mask.shape[-1])
    else:
      mask = kv_cache.cache_mask(attention_mask, cache_index, length)
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
    logits = attentions.softcap(logits.astype(jnp.float32),
                                self.final_logit_softcap)
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
