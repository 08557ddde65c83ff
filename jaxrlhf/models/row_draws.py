"""The lockstep sampler's draws, one row at a time.

  keys = row_draws.step_keys(rng, max_new_tokens)      # [M] keys
  key = row_draws.row_key(keys[t], row, vocab)         # row `row`, draw t
  token = jax.random.categorical(key, logits_of_row[None])[0]

`sampling.sample_decoder_only` draws token t of every row of its batch from
one key: it splits its key once per draw (`step_keys` replays that chain)
and calls `jax.random.categorical(key_t, logits)` on the [B, vocab] logits,
the argmax of the logits plus Gumbel noise of that shape. With JAX's
default PRNG (threefry2x32, with `jax_threefry_partitionable`, the default
since JAX 0.5) element (b, v) of the noise depends only on key_t and its
flat index b * vocab + v: the random bits are threefry2x32 of key_t and
that 64-bit counter, split in two 32-bit words, and the uniform and Gumbel
transforms are elementwise. `row_key` is a key of a PRNG implementation of
our own (`jax.extend.random.define_prng_impl`) whose bits for a [1, vocab]
draw are those counters offset by row * vocab, so JAX's own categorical
on one row's logits draws exactly what it draws for that row in the batch
(tests/test_row_draws.py checks the noise bit for bit). The continuous
engine (`engine.py`) draws each sequence this way, so that its samples are
the lockstep sampler's for the same key, whatever slot a sequence
decodes in and whenever it gets there.
"""

import jax
import jax.extend.random as jax_random
import jax.numpy as jnp
import numpy as np


def _row_bits(key_data: jax.Array, bit_width: int, shape) -> jax.Array:
  """The bits of a [..] draw under key data (k1, k2, offset_hi, offset_lo):
  threefry2x32 of (k1, k2) on the counters offset + flat index, as JAX's
  partitionable threefry computes element (offset + index) of a larger
  draw."""
  if bit_width != 32:
    raise NotImplementedError(
        f"row_draws: {bit_width}-bit draws (only float32 noise, 32 bits, "
        "is replayed).")
  size = int(np.prod(shape))
  k1, k2, hi, lo = (key_data[..., i] for i in range(4))
  index = jax.lax.iota(jnp.uint32, size).reshape(shape)
  count_lo = lo + index
  count_hi = hi + (count_lo < lo).astype(jnp.uint32)  # the carry
  bits_1, bits_2 = jax_random.threefry2x32_p.bind(
      jnp.broadcast_to(k1, shape), jnp.broadcast_to(k2, shape), count_hi,
      count_lo)
  return bits_1 ^ bits_2


def _not_a_source(*_):
  raise NotImplementedError(
      "row_draws: a row key only draws (it is not split, folded or seeded).")


_ROW_IMPL = jax_random.define_prng_impl(
    key_shape=(4,), seed=_not_a_source, split=_not_a_source,
    random_bits=_row_bits, fold_in=_not_a_source, name="lockstep_row",
    tag="lr")


def check_key(rng) -> None:
  """Raises ValueError unless `rng`'s draws can be replayed row by row: a
  threefry2x32 key under `jax_threefry_partitionable`."""
  typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
  impl = str(jax.random.key_impl(rng) if typed
             else jax.config.jax_default_prng_impl)
  if impl != "threefry2x32" or not jax.config.jax_threefry_partitionable:
    raise ValueError(
        f"the continuous engine draws each sequence as the lockstep sampler "
        f"draws its row, which needs a threefry2x32 key (this one is "
        f"{impl}) and jax_threefry_partitionable=True (it is "
        f"{jax.config.jax_threefry_partitionable}), JAX's defaults; use "
        "them, or online.engine='lockstep'.")


def step_keys(rng: jax.Array, num_draws: int) -> jax.Array:
  """[num_draws] keys: the key draw t of the lockstep sampler uses, which
  splits its key once per draw (`sampling._decode_loop`)."""
  def split(rng, _):
    rng, key = jax.random.split(rng)
    return rng, key
  return jax.lax.scan(split, rng, None, length=num_draws)[1]


def check_rows(num_rows: int, vocab: int) -> None:
  """Raises ValueError when a [num_rows, vocab] draw's flat indices reach
  2**32 (the offsets `row_key` takes are one 32-bit word)."""
  if int(num_rows) * int(vocab) >= 2 ** 32:
    raise ValueError(
        f"row_draws: {num_rows} rows x a vocabulary of {vocab} reach 2**32 "
        "draws per step; sample fewer rows at once.")


def row_key(key: jax.Array, row: jax.Array, vocab: int) -> jax.Array:
  """A key whose draw over [1, vocab] (`jax.random.categorical` of one
  row's logits) is row `row` of `key`'s draw over [rows, vocab] (rows x
  vocab below 2**32, `check_rows`)."""
  data = jax.random.key_data(key).astype(jnp.uint32)
  offset = jnp.asarray(row).astype(jnp.uint32) * jnp.uint32(vocab)
  return jax.random.wrap_key_data(
      jnp.stack([data[0], data[1], jnp.uint32(0), offset]), impl=_ROW_IMPL)
