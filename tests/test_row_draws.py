"""row_draws: one row of a batch's draw, replayed alone.

The truths are JAX's own draws: the Gumbel noise `jax.random.gumbel(key,
(rows, vocab))` row b, bit for bit, and `jax.random.categorical` of a
batch, row by row, under jit and vmap, for raw and typed keys and sizes
that are not powers of two; the draw keys of a loop that splits its key
once per draw; and the keys it cannot replay refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import row_draws


@pytest.mark.parametrize("rows,vocab", [(7, 1003), (1, 5), (16, 4096)])
@pytest.mark.parametrize("typed", [False, True])
def test_a_row_key_draws_that_row_of_the_batch(rows, vocab, typed):
  key = jax.random.key(3) if typed else jax.random.PRNGKey(3)
  noise = np.asarray(jax.random.gumbel(key, (rows, vocab)))

  @jax.jit
  def by_row(key):
    return jax.vmap(lambda b: jax.random.gumbel(
        row_draws.row_key(key, b, vocab), (1, vocab))[0])(
            jnp.arange(rows))
  np.testing.assert_array_equal(np.asarray(by_row(key)), noise)

  logits = 3.0 * jax.random.normal(jax.random.PRNGKey(1), (rows, vocab))
  want = jax.random.categorical(key, logits, axis=-1)
  got = jax.jit(jax.vmap(lambda b, row: jax.random.categorical(
      row_draws.row_key(key, b, vocab), row[None], axis=-1)[0]))(
          jnp.arange(rows), logits)
  np.testing.assert_array_equal(got, want)


def test_step_keys_are_a_loop_splitting_once_per_draw():
  rng = jax.random.PRNGKey(7)
  keys = row_draws.step_keys(rng, 4)
  for t in range(4):
    rng, key = jax.random.split(rng)
    np.testing.assert_array_equal(keys[t], key)


def test_keys_it_cannot_replay_are_refused():
  row_draws.check_key(jax.random.PRNGKey(0))
  row_draws.check_key(jax.random.key(0))
  with pytest.raises(ValueError, match="rbg"):
    row_draws.check_key(jax.random.key(0, impl="rbg"))
  with jax.threefry_partitionable(False):
    with pytest.raises(ValueError, match="jax_threefry_partitionable"):
      row_draws.check_key(jax.random.PRNGKey(0))
  row_draws.check_rows(2 ** 16, 2 ** 16 - 1)
  with pytest.raises(ValueError, match="2\\*\\*32"):
    row_draws.check_rows(2 ** 16, 2 ** 16)
