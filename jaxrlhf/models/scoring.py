"""One scoring API for encoder-decoder and decoder-only language models.

Every alignment loss consumes per-token log-probs of completions given
prompts, and a mask. `LanguageModel` adapters give both architectures that
one interface, reading the feature names of `jaxrlhf.data.feature_converters`
for a completion field `name` ("chosen", "rejected", "completion", ...; None
for the unprefixed SFT features):

  encoder-decoder: encoder_input_tokens, {name}_decoder_target_tokens,
                   {name}_decoder_input_tokens, {name}_decoder_loss_weights
  decoder-only:    {name}_tokens, {name}_positions, {name}_attention_mask,
                   {name}_loss_weights

Algorithms never branch on architecture: they call `completion_logprobs`,
`completion_hidden` and `prompt_hidden`, and use `score_many` to put several
completions of the same prompts (chosen and rejected) through one
concatenated forward pass.

Packed batches (`jaxrlhf.data.feature_converters.Packer`) hold up to k
examples per row: every sequence feature has its segment ids
(`{name}_segment_ids`; encoder-decoder `encoder_segment_ids` and
`{name}_decoder_segment_ids`), 1 .. k by slot, 0 on padding, and
`example_mask` [rows, k] says which slots hold an example, whose scalars
(`reward`, `margin`, ...) are [rows, k] too. The forward passes confine
attention to each example, and the per-example functions here
(`sequence_logprobs`, `completion_lengths`, `example_weights`,
`example_values`, `prompt_states`) return one entry per slot, [rows * k],
with `example_weights` 0 on the empty ones, so a loss that is a weighted
mean over examples is the same number as on the unpacked batch of those
examples. Chosen and rejected completions of an example sit in the same
slot of the same row of their own packed rows, so `score_many` still
concatenates them along the batch axis.
"""

import functools
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from jaxrlhf.models import moe_decoder


def token_logprobs(logits, targets):
  """log p(target_t) under softmax(logits_t), in float32.

  Args:
    logits: [batch, length, vocab].
    targets: [batch, length] int token ids.
  Returns:
    [batch, length] log-probabilities.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return target_logits - log_z


class TokenStats(NamedTuple):
  """What a token loss reads of the logits, per position ([batch, T] each):
  log Z = logsumexp(logits), the target's logit (log p(target) is their
  difference) and, when asked for, whether the target is the argmax (the
  first maximum, as `jnp.argmax`) and the entropy of softmax(logits), else
  None."""
  log_z: jax.Array
  target_logits: jax.Array
  top1: Optional[jax.Array] = None
  entropy: Optional[jax.Array] = None

  @property
  def logprobs(self) -> jax.Array:
    """log p(target) = target logit - log Z."""
    return self.target_logits - self.log_z


def entropy_from_logits(logits):
  """-sum_v p_v log p_v of softmax(logits) at each position: [..., vocab]
  -> [...]."""
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def logit_stats(logits, targets, with_top1: bool = False,
                with_entropy: bool = False) -> TokenStats:
  """`TokenStats` of float32 logits [batch, T, vocab].

  The gradient is softmax * d(log Z) + onehot(target) * d(target logit),
  formed in one pass over the logits (automatic differentiation would keep
  the exponentials for the backward pass and scatter into a zero array of
  the logits' size for the target's term).
  """
  log_z, target_logits = _log_z_and_target(logits, targets)
  top1 = None
  if with_top1:
    top1 = jnp.argmax(jax.lax.stop_gradient(logits), axis=-1) == targets
  entropy = entropy_from_logits(logits) if with_entropy else None
  return TokenStats(log_z, target_logits, top1, entropy)


@jax.custom_vjp
def _log_z_and_target(logits, targets):
  return _log_z_and_target_fwd(logits, targets)[0]


def _log_z_and_target_fwd(logits, targets):
  # As jax.nn.logsumexp: the maximum (0 where it is not finite) is taken
  # out before the exponentials.
  peak = jnp.max(logits, axis=-1, keepdims=True)
  peak = jax.lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0))
  log_z = (jnp.log(jnp.sum(jnp.exp(logits - peak), axis=-1))
           + jnp.squeeze(peak, -1))
  target_logits = jnp.take_along_axis(logits, targets[..., None],
                                      axis=-1)[..., 0]
  return (log_z, target_logits), (logits, log_z, targets)


def _log_z_and_target_bwd(residuals, cotangents):
  logits, log_z, targets = residuals
  d_log_z, d_target = cotangents
  vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  d_logits = (jnp.exp(logits - log_z[..., None]) * d_log_z[..., None]
              + jnp.where(vocab == targets[..., None], d_target[..., None],
                          0.0))
  return d_logits.astype(logits.dtype), None


_log_z_and_target.defvjp(_log_z_and_target_fwd, _log_z_and_target_bwd)


# The most bytes of float32 logits `hidden_token_stats` builds at once (per
# chunk of positions, over the whole batch); None: 8 MiB on the CPU, whose
# client page-faults a step's temporary memory afresh at every execution
# (a quarter to a half of a small model's step went to building, and
# faulting in, whole-vocabulary arrays), and 1 GiB on accelerators, where
# chunks only keep very large logits from filling the memory.
LOGITS_CHUNK_BYTES = None


def logits_chunk(batch: int, vocab: int,
                 chunk_bytes: Optional[int] = None) -> int:
  """Positions per chunk whose [batch, chunk, vocab] float32 logits take at
  most `chunk_bytes` (None: `LOGITS_CHUNK_BYTES`, or its default for the
  backend); at least 1."""
  if chunk_bytes is None:
    chunk_bytes = LOGITS_CHUNK_BYTES or (
        2**23 if jax.default_backend() == "cpu" else 2**30)
  return max(1, chunk_bytes // (4 * batch * vocab))


def hidden_token_stats(project, params, hidden, targets, *, temperature=1.0,
                       with_top1: bool = False, with_entropy: bool = False,
                       chunk_bytes: Optional[int] = None) -> TokenStats:
  """`TokenStats` of the logits `project(params, hidden) / temperature`, a
  chunk of positions at a time, so that the [batch, T, vocab] logits never
  exist at once.

  Each chunk's logits are formed, read and dropped; the backward pass forms
  them again from the chunk's states and turns them into their gradient in
  one pass (`_chunk_stats`): the step holds one chunk's logits and their
  gradient rather than several arrays of the whole batch's, at the cost of
  the output layer's forward matmul once more. When the logits take at
  most `chunk_bytes` the computation is the plain one (`logit_stats` of the
  whole logits).

  Args:
    project: (params, [batch, C, emb] states) -> [batch, C, vocab] logits
      (the model's output layer, `logits_from_hidden`).
    params: what `project` reads (differentiated).
    hidden: [batch, T, emb] final states.
    targets: [batch, T] int token ids the positions' logits score.
    temperature: the logits are divided by it.
    with_top1: also say whether each target is the argmax.
    with_entropy: also give each position's entropy (differentiable: PPO's
      entropy bonus trains through it).
    chunk_bytes: the float32 logits built at once (one chunk); None:
      `LOGITS_CHUNK_BYTES`, or its default for the backend.
  Returns:
    `TokenStats`, [batch, T] each.
  """
  batch, length = targets.shape
  vocab = jax.eval_shape(project, params, hidden[:, :1]).shape[-1]
  chunk = logits_chunk(batch, vocab, chunk_bytes)
  if chunk >= length:
    logits = project(params, hidden).astype(jnp.float32)
    if not (isinstance(temperature, (int, float)) and temperature == 1):
      logits = logits / temperature
    return logit_stats(logits, targets, with_top1, with_entropy)
  num_chunks = -(-length // chunk)
  chunk = -(-length // num_chunks)
  padded = num_chunks * chunk

  def chunks(x):
    # [batch, T, ...] -> [num_chunks, batch, chunk, ...]
    x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((batch, num_chunks, chunk) + x.shape[2:])
    return jnp.swapaxes(x, 0, 1)

  temperature = jnp.asarray(temperature, jnp.float32)

  def body(carry, xs):
    return carry, _chunk_stats(project, (with_top1, with_entropy), params,
                               *xs, temperature)

  _, out = jax.lax.scan(body, None, (chunks(hidden), chunks(targets)))
  return TokenStats(*(None if x is None else
                      jnp.swapaxes(x, 0, 1).reshape(batch, padded)[:, :length]
                      for x in out))


def _scaled_logits(project, params, hidden, temperature):
  return project(params, hidden).astype(jnp.float32) / temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunk_stats(project, extras, params, hidden, targets, temperature):
  """`TokenStats` of one chunk's logits (`extras`: (with_top1,
  with_entropy)); its gradient forms the logits again instead of keeping
  them."""
  return _chunk_stats_fwd(project, extras, params, hidden, targets,
                          temperature)[0]


def _chunk_stats_fwd(project, extras, params, hidden, targets, temperature):
  with_top1, with_entropy = extras
  logits = _scaled_logits(project, params, hidden, temperature)
  (log_z, target_logits), _ = _log_z_and_target_fwd(logits, targets)
  top1 = (jnp.argmax(logits, axis=-1) == targets) if with_top1 else None
  entropy = None
  if with_entropy:
    # H = -sum_v p_v log p_v, log p = logits - log Z.
    log_probs = logits - log_z[..., None]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
  return (TokenStats(log_z, target_logits, top1, entropy),
          (params, hidden, targets, temperature, log_z, entropy))


def _chunk_stats_bwd(project, extras, residuals, cotangents):
  del extras
  params, hidden, targets, temperature, log_z, entropy = residuals
  logits, vjp = jax.vjp(
      lambda p, h: _scaled_logits(project, p, h, temperature), params, hidden)
  d_logits, _ = _log_z_and_target_bwd(
      (logits, log_z, targets), (cotangents.log_z, cotangents.target_logits))
  if entropy is not None:
    # dH/dlogit_v = p_v (E_p[logit] - logit_v) = -p_v (log p_v + H).
    log_probs = logits - log_z[..., None]
    d_logits = d_logits - cotangents.entropy[..., None] * jnp.exp(
        log_probs) * (log_probs + entropy[..., None])
  d_params, d_hidden = vjp(d_logits)
  return d_params, d_hidden, None, jnp.zeros_like(temperature)


_chunk_stats.defvjp(_chunk_stats_fwd, _chunk_stats_bwd)


def _key(name: Optional[str], suffix: str) -> str:
  return suffix if name is None else f"{name}_{suffix}"


# Packed batches: which slots of a row hold an example ([rows, k]).
EXAMPLE_MASK = "example_mask"


def is_packed(batch) -> bool:
  """Whether `batch` holds packed rows (several examples per row)."""
  return EXAMPLE_MASK in batch


def examples_per_row(batch) -> Optional[int]:
  """k, the example slots of a packed row; None unpacked."""
  return batch[EXAMPLE_MASK].shape[-1] if is_packed(batch) else None


def example_weights(batch) -> Optional[jax.Array]:
  """[rows * k] float32, 1 on the slots holding an example, for a packed
  batch; None (every row one example) unpacked."""
  if not is_packed(batch):
    return None
  return batch[EXAMPLE_MASK].reshape(-1).astype(jnp.float32)


def example_values(batch, key: str) -> jax.Array:
  """A per-example feature (`reward`, `label`, `margin`, ...): [batch]
  unpacked, [rows * k] packed (one entry per slot)."""
  value = batch[key]
  return value.reshape(-1) if is_packed(batch) else value


def per_example_sums(values, segment_ids, k: Optional[int]):
  """Sums of [rows, L] per-token values per example: [rows] unpacked
  (k None), [rows * k] packed, by the slots' segment ids 1 .. k."""
  if k is None:
    return jnp.sum(values, axis=-1)
  slots = jax.nn.one_hot(segment_ids - 1, k, dtype=values.dtype)
  return jnp.einsum("rl,rlk->rk", values, slots).reshape(-1)


def segment_starts(segment_ids):
  """bool [rows, L]: the first token of each segment (and of the row)."""
  first = jnp.ones(segment_ids.shape[:-1] + (1,), bool)
  return jnp.concatenate(
      [first, segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)


class _Adapter:
  """Adapters of equal modules (the same family and config) are equal, so
  functions jitted per adapter (evaluation samplers, reward scoring) are
  shared by every run of one model in a process, e.g. a pipeline's stages."""

  def __init__(self, module):
    self.module = module

  def __eq__(self, other):
    return type(other) is type(self) and other.module == self.module

  def __hash__(self):
    return hash((type(self), self.module))


class EncoderDecoderLM(_Adapter):
  """Scoring adapter for `jaxrlhf.models.t5.T5`."""
  is_encoder_decoder = True

  def completion_keys(self, name):
    return [_key(name, s) for s in ("decoder_target_tokens",
                                    "decoder_input_tokens",
                                    "decoder_loss_weights")]

  prompt_keys = ("encoder_input_tokens",)

  def segment_keys(self, name):
    """The packed batch's segment-id features of completion `name`, and of
    the prompt (`encoder_segment_ids`)."""
    return [_key(name, "decoder_segment_ids")], ["encoder_segment_ids"]

  def _apply(self, params, batch, name, return_hidden, rng=None):
    deterministic = rng is None
    segments = {}
    if _key(name, "decoder_segment_ids") in batch:
      segments = {"encoder_segment_ids": batch["encoder_segment_ids"],
                  "decoder_segment_ids": batch[_key(name,
                                                    "decoder_segment_ids")]}
    return self.module.apply(
        {"params": params}, batch["encoder_input_tokens"],
        batch[_key(name, "decoder_input_tokens")],
        batch[_key(name, "decoder_target_tokens")],
        deterministic=deterministic, return_hidden=return_hidden,
        rngs=None if deterministic else {"dropout": rng}, **segments)

  def completion_segment_ids(self, batch, name=None):
    """[batch, Lc] segment ids of completion `name`'s target tokens."""
    return batch[_key(name, "decoder_segment_ids")]

  def completion_logits(self, params, batch, name=None, rng=None):
    """[batch, Lc, vocab] logits; position t predicts target token t."""
    return self._apply(params, batch, name, False, rng)

  def next_token_stats(self, params, batch, name=None, temperature=1.0,
                       rng=None, with_top1=False, with_entropy=False,
                       last: Optional[int] = None) -> TokenStats:
    """`TokenStats` [batch, Lc] of the target tokens, from the decoder's
    logits (the computation of `token_logprobs`). `last` is the decoder-only
    adapter's argument; here every target is a completion token, so it must
    be None or Lc."""
    logits = self.completion_logits(params, batch, name, rng)
    targets = batch[_key(name, "decoder_target_tokens")]
    if last not in (None, targets.shape[1]):
      raise ValueError(f"last={last}: an encoder-decoder's targets are all "
                       f"{targets.shape[1]} completion tokens.")
    if not (isinstance(temperature, (int, float)) and temperature == 1):
      logits = logits / temperature
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None],
                                        axis=-1)[..., 0]
    top1 = (jnp.argmax(logits, axis=-1) == targets) if with_top1 else None
    entropy = entropy_from_logits(logits) if with_entropy else None
    return TokenStats(log_z, target_logits, top1, entropy)

  def completion_logprobs(self, params, batch, name=None, temperature=1.0,
                          rng=None) -> Tuple[jax.Array, jax.Array]:
    """(log p(target_t | prompt, targets_<t) [batch, Lc], mask [batch, Lc]).

    Logits are divided by `temperature` first, so the log-probs are those of
    the distribution a sampler at that temperature draws from.
    """
    logits = self.completion_logits(params, batch, name, rng)
    logprobs = token_logprobs(logits / temperature,
                              batch[_key(name, "decoder_target_tokens")])
    mask = batch[_key(name, "decoder_loss_weights")].astype(jnp.float32)
    return logprobs * mask, mask

  def response_states(self, params, batch, length: int, routes=None):
    """(states [batch, L, ...], project): what position t's next-token
    logits over the vocabulary are made from, for the L = `length` target
    tokens, and the function making them (`project(states[:, a:b])` ->
    [batch, b - a, vocab]). T5's decoder yields its logits whole, so here
    the states are those logits and `project` is the identity. (`routes`:
    the decoder-only adapter's; T5 has no experts, so None.)"""
    if routes is not None:
      raise ValueError("response_states: T5 has no experts to replay "
                       "routes in.")
    logits = self.completion_logits(params, batch)
    if logits.shape[1] != length:
      raise ValueError(f"response_states: length={length}, but an "
                       f"encoder-decoder's {logits.shape[1]} targets are all "
                       "completion tokens.")
    return logits, lambda states: states

  def completion_hidden(self, params, batch, name=None, rng=None):
    """(states [batch, Lc, emb], mask [batch, Lc]); state t has read target
    tokens < t and, at the last real target (the EOS), the whole completion."""
    hidden = self._apply(params, batch, name, True, rng)
    return hidden, batch[_key(name, "decoder_loss_weights")].astype(jnp.float32)

  def prompt_hidden(self, params, batch, rng=None):
    """(encoder states [batch, Lp, emb], mask [batch, Lp]) of the prompt."""
    tokens = batch["encoder_input_tokens"]
    hidden = self.module.apply({"params": params}, tokens,
                               deterministic=rng is None,
                               encoder_segment_ids=batch.get(
                                   "encoder_segment_ids"),
                               rngs=None if rng is None else {"dropout": rng},
                               method=self.module.encode)
    return hidden, (tokens > 0).astype(jnp.float32)

  def packed_prompt_hidden(self, params, batch, name, rng=None):
    """A packed batch's (prompt states [rows, Lp, emb], mask, segment ids):
    the encoder's."""
    del name
    hidden, mask = self.prompt_hidden(params, batch, rng)
    return hidden, mask, batch["encoder_segment_ids"]


class DecoderOnlyLM(_Adapter):
  """Scoring adapter for decoder-only modules with `hidden_states` and
  `logits_from_hidden` (jaxrlhf.models.llama, gpt_neox, t5x_decoder_only)."""
  is_encoder_decoder = False

  def completion_keys(self, name):
    return [_key(name, s) for s in ("tokens", "positions", "attention_mask",
                                    "loss_weights")]

  prompt_keys = ("prompt_tokens", "prompt_positions", "prompt_attention_mask")

  def segment_keys(self, name):
    """The packed batch's segment-id features of completion `name`, and of
    the prompt (none: packed prompts sit in the completion rows)."""
    return [_key(name, "segment_ids")], []

  def _inputs(self, batch, name):
    """(args, kwargs) of a forward pass over completion `name`'s rows."""
    args = tuple(batch[_key(name, s)] for s in ("tokens", "positions",
                                                "attention_mask"))
    if _key(name, "segment_ids") not in batch:
      return args, {}
    return args, {"segment_ids": batch[_key(name, "segment_ids")],
                  "max_segments": examples_per_row(batch)}

  def _forward(self, params, batch, name, method=None, routes=None):
    """The module applied to completion `name`'s rows; through
    `moe_decoder.apply`, which records a trained MoE model's routing over
    the rows' real tokens (the router's loss in training) and replays
    `routes` (int [batch, L, moe layers, top_k], or None) in a MoE
    model."""
    args, kwargs = self._inputs(batch, name)
    return moe_decoder.apply(self.module, params, args, kwargs,
                             batch[_key(name, "attention_mask")], method,
                             replayed=routes)

  def _hidden(self, params, batch, name, routes=None):
    return self._forward(params, batch, name, self.module.hidden_states,
                         routes)

  def completion_segment_ids(self, batch, name=None):
    """[batch, L] segment ids of completion `name`'s rows."""
    return batch[_key(name, "segment_ids")]

  def completion_logits(self, params, batch, name=None, rng=None):
    """[batch, L, vocab] logits of prompt+completion; position t predicts t+1."""
    del rng  # decoder-only models here have no dropout
    return self._forward(params, batch, name)

  def next_token_stats(self, params, batch, name=None, temperature=1.0,
                       rng=None, with_top1=False, with_entropy=False,
                       last: Optional[int] = None,
                       routes=None) -> TokenStats:
    """`TokenStats` [batch, L - 1] of tokens 1 .. L - 1 given the tokens
    before them (position t's logits score token t + 1), or with `last` of
    the last `last` tokens only ([batch, last]: an online response's), from
    the final states a chunk of positions at a time (`hidden_token_stats`):
    the [batch, L, vocab] logits are never built. `routes`: what a MoE
    model replays (`_forward`)."""
    del rng  # decoder-only models here have no dropout
    hidden = self._hidden(params, batch, name, routes)
    tokens = batch[_key(name, "tokens")]
    start = 1 if last is None else tokens.shape[1] - last
    if not 1 <= start < tokens.shape[1]:
      raise ValueError(f"last={last}: the rows hold {tokens.shape[1]} "
                       "tokens, and the first has no logits scoring it.")
    return hidden_token_stats(self._project, params, hidden[:, start - 1:-1],
                              tokens[:, start:], temperature=temperature,
                              with_top1=with_top1, with_entropy=with_entropy)

  def response_states(self, params, batch, length: int, routes=None):
    """(final states [batch, L, emb], project): the states whose logits
    (`project(states[:, a:b])` -> [batch, b - a, vocab], the output layer)
    predict the last L = `length` tokens of the rows (an online response
    of `jaxrlhf.rl.rollout.response_features`): position t's state has
    read the tokens before response token t. `routes`: what a MoE model
    replays (`_forward`)."""
    hidden = self._hidden(params, batch, None, routes)
    total = hidden.shape[1]
    if not 1 <= length < total:
      raise ValueError(f"response_states: length={length}, but the rows "
                       f"hold {total} tokens, and the first has no logits "
                       "scoring it.")
    return (hidden[:, total - length - 1:-1],
            lambda states: self._project(params, states))

  def _project(self, params, hidden):
    """The output layer: final states [..., emb] -> logits [..., vocab]."""
    return self.module.apply({"params": params}, hidden,
                             method=self.module.logits_from_hidden)

  def completion_logprobs(self, params, batch, name=None, temperature=1.0,
                          rng=None):
    """(log p(token_t | tokens_<t) [batch, L], mask [batch, L]).

    Entry t scores token t (0 at t = 0, and at the first token of each
    packed example, which nothing of its example precedes); the mask is 1
    on completion tokens (EOS included), so prompt and padding never count.
    """
    stats = self.next_token_stats(params, batch, name, temperature, rng)
    lp = jnp.pad(stats.target_logits - stats.log_z, ((0, 0), (1, 0)))
    if _key(name, "segment_ids") in batch:
      lp = jnp.where(segment_starts(batch[_key(name, "segment_ids")]), 0.0,
                     lp)
    mask = batch[_key(name, "loss_weights")].astype(jnp.float32)
    return lp * mask, mask

  def completion_hidden(self, params, batch, name=None, rng=None):
    """(states [batch, L, emb], mask): state t has read tokens <= t, so the
    state at the last completion token (EOS) has read the whole completion."""
    del rng
    hidden = self._hidden(params, batch, name)
    return hidden, batch[_key(name, "loss_weights")].astype(jnp.float32)

  def prompt_hidden(self, params, batch, rng=None):
    del rng
    hidden = self._hidden(params, batch, "prompt")
    return hidden, batch["prompt_attention_mask"].astype(jnp.float32)

  def packed_prompt_hidden(self, params, batch, name, rng=None):
    """A packed batch's (prompt states [rows, L, emb], mask, segment ids):
    the states of completion `name`'s rows at their prompt tokens, which
    causal attention keeps from reading the completion."""
    hidden, weights = self.completion_hidden(params, batch, name, rng)
    real = batch[_key(name, "attention_mask")] > 0
    mask = (real & (weights == 0)).astype(jnp.float32)
    return hidden, mask, batch[_key(name, "segment_ids")]


def adapter_for(module):
  """The scoring adapter of a model: EncoderDecoderLM for T5 (anything with
  `encode` and `decode`), DecoderOnlyLM for the decoder-only families."""
  if hasattr(module, "encode") and hasattr(module, "decode"):
    return EncoderDecoderLM(module)
  return DecoderOnlyLM(module)


def concatenate_completions(lm, batch, names: Sequence[str],
                            joined: str = "joined"):
  """A batch with the completions `names` stacked along the batch axis.

  The prompt features are repeated once per name; the result has completion
  field `joined` and len(names) * batch rows, chosen rows first.
  """
  out = {}
  suffixes = list(lm.completion_keys(None))
  completion_segments, prompt_segments = lm.segment_keys(None)
  if _key(names[0], completion_segments[0]) in batch:
    suffixes += completion_segments
  for suffix_key in suffixes:
    parts = [batch[_key(n, suffix_key)] for n in names]
    width = max(p.shape[1] for p in parts)
    parts = [jnp.pad(p, ((0, 0), (0, width - p.shape[1]))) for p in parts]
    out[_key(joined, suffix_key)] = jnp.concatenate(parts, axis=0)
  for key in tuple(lm.prompt_keys) + tuple(prompt_segments):
    if key in batch:
      out[key] = jnp.concatenate([batch[key]] * len(names), axis=0)
  if is_packed(batch):
    out[EXAMPLE_MASK] = jnp.concatenate([batch[EXAMPLE_MASK]] * len(names),
                                        axis=0)
  return out


def score_many(lm, params, batch, names: Sequence[str], temperature=1.0,
               rng=None) -> Dict[str, Tuple[jax.Array, jax.Array]]:
  """Per-token log-probs and masks of several completions of the same
  prompts, from one forward pass over their concatenation.

  Returns {name: (logprobs [batch, L], mask [batch, L])}, L the longest
  completion length among `names`.
  """
  joined = concatenate_completions(lm, batch, names)
  logprobs, mask = lm.completion_logprobs(params, joined, "joined",
                                          temperature, rng)
  n = len(names)
  return {name: (lp, m) for name, lp, m in zip(
      names, jnp.split(logprobs, n), jnp.split(mask, n))}


def _example_sums(lm, batch, name, values):
  """[rows, L] values of completion `name`'s tokens summed per example."""
  k = examples_per_row(batch)
  ids = None if k is None else lm.completion_segment_ids(batch, name)
  return per_example_sums(values, ids, k)


def sequence_logprobs(lm, params, batch, names: Sequence[str], rng=None
                      ) -> Dict[str, jax.Array]:
  """{name: [batch] log pi(completion | prompt)} of the completions `names`
  (chosen and rejected, ...) from one forward pass (`score_many`); one per
  slot, [rows * k], for a packed batch."""
  scored = score_many(lm, params, batch, names, rng=rng)
  return {n: _example_sums(lm, batch, n, lp) for n, (lp, _) in scored.items()}


def completion_lengths(lm, batch, names: Sequence[str]
                       ) -> Dict[str, jax.Array]:
  """{name: [batch] completion tokens (EOS included)}, any architecture;
  [rows * k] for a packed batch."""
  suffix = ("decoder_loss_weights" if lm.is_encoder_decoder
            else "loss_weights")
  return {n: _example_sums(lm, batch, n, batch[_key(n, suffix)])
          for n in names}


def prompt_states(lm, params, batch, name: str, rng=None) -> jax.Array:
  """The mean prompt state of each example (what DRO-V's value head reads):
  [batch, emb] unpacked, [rows * k, emb] packed (prompts read in
  completion `name`'s rows for decoder-only models)."""
  if not is_packed(batch):
    return masked_mean_states(*lm.prompt_hidden(params, batch, rng))
  hidden, mask, ids = lm.packed_prompt_hidden(params, batch, name, rng)
  k = examples_per_row(batch)
  slots = jax.nn.one_hot(ids - 1, k, dtype=jnp.float32) * mask[..., None]
  sums = jnp.einsum("rle,rlk->rke", hidden.astype(jnp.float32), slots)
  counts = jnp.maximum(jnp.sum(slots, axis=1), 1)[..., None]
  pooled = (sums / counts).astype(hidden.dtype)
  return pooled.reshape(-1, hidden.shape[-1])


def last_token_states(hidden, mask):
  """States at each row's last masked position: [batch, L, E] -> [batch, E].

  For completions this is the EOS, where a reward model reads its score
  (PPO implementation details, detail 12).
  """
  length = mask.shape[-1]
  last = length - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=-1)
  return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def masked_mean_states(hidden, mask):
  """Mean of the states over masked positions: [batch, L, E] -> [batch, E]."""
  m = mask[..., None].astype(hidden.dtype)
  return jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1)
