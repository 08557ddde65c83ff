"""Turns of B conversations with a decoder-only model, the KV cache kept
between them.

A multi-turn rollout alternates the model's turns and an environment's
answers. Here the conversations' KV cache lives on the device from turn to
turn (`Context`): `start` prefills the left-padded openings once, `decode`
draws a turn, and `extend` appends the environment's tokens to the cache;
nothing already in the cache is computed again.

  context = start(model, params, tokens, mask, width=1024)
  turn, context = decode(model, params, context, key, 64, active, end_id)
  context = extend(model, params, context, block_tokens, block_mask)
  turn, context = decode(model, params, context, key, 64, active, end_id)

The cache has `width` columns, shared by the rows: every call writes the
same columns for every row (`Context.column` onwards), and a row with
nothing to write there (an inactive row, a row whose turn has ended, the
holes before a short block) leaves them masked (`cache_mask` 0). The
attention mask over the cache may thus have holes; the rotary positions are
passed explicitly, each row's counting its real tokens only (`num_real`),
so a row attends and is rotated exactly as its hole-free sequence would be
in a fresh prefill (`tests/test_turn_sampler.py` checks it). `room` says
how many columns are left; once too few are, the caller prefills afresh.

`decode` feeds every token it draws, the last one too (unlike
`sampling.sample_decoder_only`, which never feeds its last): the next turn
continues after it. Its loop reads the weights cast once to the compute
dtype, and the query, key and value projections (and a gated MLP's two
input projections) joined, as `sampling` does
(`param_recording.cast_read_params`, `fuse_projections`); `start` and
`extend`, one model call each, read the parameters as they are.

With `record_routes` (router replay) a mixture-of-experts model's calls
record the experts every token they feed was routed to (`Context.routes`,
`Turn.routes`).
"""

from typing import Any, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import moe_decoder
from jaxrlhf.models import row_draws
from jaxrlhf.models import sampling
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import param_recording
from jaxrlhf.models.layers import rotary


@flax.struct.dataclass
class Context:
  """B conversations' device state between calls."""
  cache: Any             # the model's flax "cache" collection, W columns
  cache_mask: jax.Array  # [B, W] int32, 1 = a real token at that column
  num_real: jax.Array    # [B] int32 real tokens so far (the next token's
  #                        rotary position)
  logits: jax.Array      # [B, vocab] float32 next-token logits after each
  #                        row's last real token
  column: jax.Array      # int32 []: the next free cache column (all rows)
  # [B, m, moe layers, top_k] int32: the experts of the m tokens the call
  # that made it fed (`start`: the openings' columns, `extend`: the
  # block's), with record_routes; else None.
  routes: Any = None


@flax.struct.dataclass
class Turn:
  """One turn drawn by `decode` for B rows."""
  tokens: jax.Array    # [B, max_tokens] int32, 0 after the end and for
  #                      inactive rows
  logprobs: jax.Array  # [B, max_tokens] float32 log-probs of the drawn
  #                      tokens at the sampling temperature (greedy: at
  #                      temperature 1, as `sampling.Samples`), 0 where no
  #                      token was drawn
  lengths: jax.Array   # [B] int32 tokens drawn (end_id included)
  ended: jax.Array     # [B] bool: drew end_id
  # [B, max_tokens, moe layers, top_k] int32: the experts of each drawn
  # token (all are fed), -1 where none was drawn; with record_routes, else
  # None.
  routes: Any = None


def bucket(n: int, smallest: int) -> int:
  """n rounded up to a power of two, at least `smallest` (fewer distinct
  compiled shapes across calls)."""
  size = smallest
  while size < n:
    size *= 2
  return size


def room(context: Context) -> int:
  """The cache columns left: width - column (a host int)."""
  return int(context.cache_mask.shape[1]) - int(context.column)


def _step(model, params, cache, tokens, positions, cache_mask, index,
          routes=False):
  """One `decode_step` call: (float32 logits [B, vocab] after the last of
  `tokens` [B, L], the cache written at columns index .. index + L - 1,
  the tokens' experts [B, L, moe layers, top_k] when `routes`, else None).
  `cache` None creates it, with cache_mask.shape[1] columns."""
  variables = {"params": params}
  if cache is not None:
    variables["cache"] = cache
  logits, cache, routed = sampling.decode_step(
      model, variables, tokens, positions, cache_mask, index, routes=routes)
  return logits.astype(jnp.float32), cache, routed


# ----------------------------------------------------------------------------
# The compiled bodies (model and sizes static).

def _start(model, params, tokens, mask, width, record_routes):
  model = sampling._inference_module(model)  # pylint: disable=protected-access
  tokens = jnp.asarray(tokens, jnp.int32)
  mask = jnp.asarray(mask).astype(jnp.int32)
  batch, length = tokens.shape
  cache_mask = jnp.zeros((batch, width), jnp.int32).at[:, :length].set(mask)
  logits, cache, routed = _step(model, params, None, tokens,
                                rotary.positions_from_mask(mask), cache_mask,
                                0, record_routes)
  return Context(cache=cache, cache_mask=cache_mask,
                 num_real=jnp.sum(mask, axis=-1).astype(jnp.int32),
                 logits=logits, column=jnp.int32(length), routes=routed)


def _extend(model, params, context, tokens, mask, record_routes):
  model = sampling._inference_module(model)  # pylint: disable=protected-access
  tokens = jnp.asarray(tokens, jnp.int32)
  mask = jnp.asarray(mask).astype(jnp.int32)
  # Each row's new tokens continue its rotary positions; the holes before
  # them are masked, their positions unused.
  positions = context.num_real[:, None] + jnp.maximum(
      jnp.cumsum(mask, axis=-1) - 1, 0)
  zero = jnp.zeros((), jnp.int32)
  cache_mask = jax.lax.dynamic_update_slice(context.cache_mask, mask,
                                            (zero, context.column))
  logits, cache, routed = _step(model, params, context.cache, tokens,
                                positions, cache_mask, context.column,
                                record_routes)
  # decode_step gives the block's last column's logits: a row's last new
  # token (right-aligned), or a hole for a row with none, which keeps its
  # own.
  some = jnp.any(mask > 0, axis=-1)
  return Context(cache=cache, cache_mask=cache_mask,
                 num_real=context.num_real + jnp.sum(mask, axis=-1),
                 logits=jnp.where(some[:, None], logits, context.logits),
                 column=context.column + tokens.shape[1], routes=routed)


def _decode_params(model, params, context, fuse_projections):
  """`params` as the decode loop reads them (`sampling._decode_params`):
  the reads and fusions recorded by tracing one step (`jax.eval_shape`:
  traced only, never run)."""
  batch = context.num_real.shape[0]
  with param_recording.recording_param_reads() as reads, \
      param_recording.recording_param_fusions() as fusions:
    jax.eval_shape(
        lambda p, c: _step(model, p, c.cache, jnp.zeros((batch, 1), jnp.int32),
                           c.num_real[:, None], c.cache_mask, c.column)[:2],
        params, context)
  return sampling._decode_params(  # pylint: disable=protected-access
      params, reads, fusions, fuse_projections)


def choose(logits, key, temperature, greedy, row=None):
  """One draw of B rows from one key, as every turn sampler draws: logits
  [B, vocab] float32 -> (the key split once, tokens [B] int32, log-probs
  [B] at the sampling temperature; greedy: argmax, log-probs at 1). With
  `row` (B = 1): the draw of row `row` of a batch drawn with the same key
  (`row_draws.row_key`)."""
  key, draw_key = jax.random.split(key)
  if row is not None:
    draw_key = row_draws.row_key(draw_key, row, logits.shape[-1])
  scaled = sampling.filter_logits(logits, 1.0 if greedy else temperature)
  if greedy:
    token = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
  else:
    token = jax.random.categorical(draw_key, scaled, axis=-1).astype(
        jnp.int32)
  logprob = jnp.take_along_axis(jax.nn.log_softmax(scaled),
                                token[:, None], axis=-1)[:, 0]
  return key, token, logprob


def _decode(model, params, context, key, active, max_tokens, end_id,
            temperature, greedy, fuse_projections, record_routes):
  model = sampling._inference_module(model)  # pylint: disable=protected-access
  params = _decode_params(model, params, context, fuse_projections)
  routes = None
  if record_routes:
    routes = jnp.full((active.shape[0], max_tokens)
                      + moe_decoder.route_shape(model.config), -1, jnp.int32)
  active = jnp.asarray(active, bool)
  batch = active.shape[0]
  zero = jnp.zeros((), jnp.int32)

  def keep_going(carry):
    t, done = carry[0], carry[5]
    return (t < max_tokens) & ~jnp.all(done)

  def body(carry):
    (t, logits, cache, cache_mask, num_real, done, ended, key, tokens,
     logprobs, routes) = carry
    key, token, logprob = choose(logits, key, temperature, greedy)
    # A row still in its turn draws; the others write a masked column.
    live = ~done
    token = jnp.where(live, token, 0)
    logprob = jnp.where(live, logprob, 0.0)
    tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (zero, t))
    logprobs = jax.lax.dynamic_update_slice(logprobs, logprob[:, None],
                                            (zero, t))
    index = context.column + t
    cache_mask = jax.lax.dynamic_update_slice(
        cache_mask, live.astype(jnp.int32)[:, None], (zero, index))
    # Every drawn token is fed, the last one too: the next call continues
    # after it.
    new_logits, cache, routed = _step(model, params, cache, token[:, None],
                                      num_real[:, None], cache_mask, index,
                                      record_routes)
    if record_routes:
      routed = jnp.where(live[:, None, None, None], routed, -1)
      routes = jax.lax.dynamic_update_slice(routes, routed,
                                            (zero, t, zero, zero))
    logits = jnp.where(live[:, None], new_logits, logits)
    num_real = num_real + live.astype(jnp.int32)
    ended = ended | (live & (token == end_id))
    return (t + 1, logits, cache, cache_mask, num_real, done | ended, ended,
            key, tokens, logprobs, routes)

  carry = (jnp.int32(0), context.logits, context.cache, context.cache_mask,
           context.num_real, ~active, jnp.zeros((batch,), bool), key,
           jnp.zeros((batch, max_tokens), jnp.int32),
           jnp.zeros((batch, max_tokens), jnp.float32), routes)
  (steps, logits, cache, cache_mask, num_real, _, ended, _, tokens,
   logprobs, routes) = jax.lax.while_loop(keep_going, body, carry)
  turn = Turn(tokens=tokens, logprobs=logprobs,
              lengths=num_real - context.num_real, ended=ended, routes=routes)
  return turn, Context(cache=cache, cache_mask=cache_mask, num_real=num_real,
                       logits=logits, column=context.column + steps)


# pylint: disable=protected-access
_start_jit = sampling._jit_static(_start, ("model", "width",
                                           "record_routes"))
_extend_jit = sampling._jit_static(_extend, ("model", "record_routes"))
_decode_jit = sampling._jit_static(
    _decode, ("model", "max_tokens", "end_id", "temperature", "greedy",
              "fuse_projections", "record_routes"))
# pylint: enable=protected-access


# ----------------------------------------------------------------------------
# Host-side checks and the public calls.

def _host_mask(name, mask, shape):
  """`mask` as a host bool array of `shape`, or a one-line ValueError."""
  mask = np.asarray(mask)
  if mask.shape != shape:
    raise ValueError(f"{name}: the mask's shape {mask.shape} is not the "
                     f"tokens' {shape}; pass one 0/1 per token.")
  return mask.astype(bool)


def _check_room(what, needed, context):
  left = room(context)
  if needed > left:
    raise ValueError(
        f"turn_sampler.{what} needs {needed} cache columns but the cache has "
        f"{left} left (of {context.cache_mask.shape[1]}): prefill the "
        "conversations afresh with `start` (or a larger width).")


def _check_window(model, width):
  """Refuses a sliding-window model whose window a cache of `width`
  columns could exceed: the layers measure the window in cache columns
  (`attentions.window_mask`), which the holes make more than the positions
  between two real tokens, so such a window would drop keys that a fresh
  prefill keeps."""
  config = getattr(model, "config", None)
  window = getattr(config, "sliding_window", None)
  types = getattr(config, "attention_types", (attentions.SLIDING_ATTENTION,))
  if (window is not None and attentions.SLIDING_ATTENTION in types
      and width > window):
    raise ValueError(
        f"turn_sampler.start: {type(config).__name__} attends within a "
        f"sliding window of {window} positions, which a cache with holes "
        f"measures in columns; use width <= {window}, or prefill each turn "
        "afresh.")


def start(model, params, tokens, mask, width: int,
          record_routes: bool = False) -> Context:
  """Prefills B conversations' openings into a KV cache of `width` columns.

  Args:
    model: a decoder-only module (`decode_step(tokens, positions,
      attention_mask, cache_index)`: Llama, Qwen, Gemma, GPT-NeoX, ...).
    params: its parameters (the tree under "params").
    tokens: int [B, Lp] openings, LEFT-padded (each row's last column is its
      last token).
    mask: [B, Lp], 1 = real token; every row has at least one.
    width: the cache's columns, >= Lp: the openings, then every later
      turn's and block's columns (at most a sliding-window model's
      window: `_check_window`).
    record_routes: a mixture-of-experts model records the openings'
      experts (`Context.routes`); ignored for other models.
  Returns:
    The Context after the openings (column Lp).
  """
  tokens = np.asarray(tokens) if not isinstance(tokens, jax.Array) else tokens
  if tokens.ndim != 2:
    raise ValueError(f"turn_sampler.start: tokens must be [batch, length], "
                     f"got shape {tokens.shape}.")
  real = _host_mask("turn_sampler.start", mask, tuple(tokens.shape))
  if not isinstance(width, (int, np.integer)) or width < tokens.shape[1]:
    raise ValueError(f"turn_sampler.start: width={width!r} must be an int "
                     f"of at least the openings' {tokens.shape[1]} columns.")
  _check_window(model, width)
  bad = np.flatnonzero(np.any(real[:, :-1] & ~real[:, 1:], axis=-1)
                       | ~np.any(real, axis=-1))
  if bad.size:
    raise ValueError(
        f"turn_sampler.start: rows {bad[:5].tolist()} are empty or not "
        "left-padded; pad each opening on the left (its last column real).")
  return _start_jit(model=model, params=params, tokens=tokens, mask=mask,
                    width=int(width),
                    record_routes=sampling.records_routes(model,
                                                          record_routes))


def extend(model, params, context: Context, tokens, mask,
           record_routes: bool = False) -> Context:
  """Appends a block of new tokens (an environment's answer) to the cache.

  Args:
    model, params: as in `start`.
    context: the conversations so far.
    tokens: int [B, m] written at columns column .. column + m - 1; each
      row's new tokens RIGHT-aligned (its holes first), so the block's last
      column is each row's last new token.
    mask: [B, m], 1 = a new token; a row of 0s adds nothing (its logits
      stay).
    record_routes: as in `start` (the block's experts).
  Returns:
    The Context after the block (column + m). Raises ValueError when the
    cache has fewer than m columns left.
  """
  tokens = np.asarray(tokens) if not isinstance(tokens, jax.Array) else tokens
  batch = context.num_real.shape[0]
  if tokens.ndim != 2 or tokens.shape[0] != batch:
    raise ValueError(f"turn_sampler.extend: tokens must be [batch={batch}, "
                     f"m], got shape {tokens.shape}.")
  real = _host_mask("turn_sampler.extend", mask, tuple(tokens.shape))
  bad = np.flatnonzero(np.any(real[:, :-1] & ~real[:, 1:], axis=-1))
  if bad.size:
    raise ValueError(
        f"turn_sampler.extend: rows {bad[:5].tolist()} have a hole after a "
        "new token; right-align each row's tokens (holes first).")
  _check_room("extend", tokens.shape[1], context)
  return _extend_jit(model=model, params=params,
                     context=context.replace(routes=None),
                     tokens=tokens, mask=mask,
                     record_routes=sampling.records_routes(model,
                                                           record_routes))


def decode(model, params, context: Context, key, max_tokens: int, active,
           end_id: int, temperature: float = 1.0, greedy: bool = False,
           fuse_projections: bool = True, record_routes: bool = False
           ) -> Tuple[Turn, Context]:
  """Draws a turn of at most `max_tokens` tokens for the active rows.

  The rows decode in lockstep; an active row stops after drawing end_id,
  and the loop stops once every active row has stopped (or after
  max_tokens steps). Inactive and stopped rows draw nothing and leave their
  columns masked. Every drawn token is written into the cache.

  Args:
    model, params: as in `start`.
    context: the conversations so far.
    key: a PRNG key (unused, and may be None, when greedy).
    max_tokens: static, the most tokens a row draws.
    active: bool [B], the rows that take a turn.
    end_id: the end-of-turn id.
    temperature: the sampling temperature (> 0; 0 means greedy).
    greedy: argmax; the log-probs are then at temperature 1.
    fuse_projections: static; as `sampling.sample_decoder_only`'s (the
      loop reads joined projections where it casts the weights).
    record_routes: static; as in `start` (`Turn.routes`).
  Returns:
    (the Turn, the Context after it: column + the steps run). Raises
    ValueError when the cache has fewer than max_tokens columns left.
  """
  if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
    raise ValueError(f"turn_sampler.decode: max_tokens must be a positive "
                     f"int, got {max_tokens!r}.")
  if isinstance(temperature, jax.Array) or not temperature >= 0:
    raise ValueError(f"turn_sampler.decode: temperature must be a Python "
                     f"number >= 0 (0 = greedy), got {temperature!r}.")
  batch = context.num_real.shape[0]
  if np.shape(active) != (batch,):
    raise ValueError(f"turn_sampler.decode: active must be [batch={batch}] "
                     f"bools, got shape {np.shape(active)}.")
  _check_room("decode", int(max_tokens), context)
  greedy = bool(greedy) or temperature == 0
  if key is None:
    if not greedy:
      raise ValueError("turn_sampler.decode: sampling at a temperature "
                       "needs a PRNG key, got key=None.")
    key = jax.random.PRNGKey(0)  # split, never read
  return _decode_jit(model=model, params=params,
                     context=context.replace(routes=None), key=key,
                     active=active, max_tokens=int(max_tokens),
                     end_id=int(end_id),
                     temperature=1.0 if greedy else float(temperature),
                     greedy=greedy, fuse_projections=bool(fuse_projections),
                     record_routes=sampling.records_routes(model,
                                                           record_routes))
