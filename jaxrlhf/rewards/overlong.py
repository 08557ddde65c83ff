"""DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13).

A response cut at the length limit is penalised, and one approaching it is
penalised in proportion, so that the policy learns to finish in time rather
than being rewarded or punished arbitrarily for truncated text:

  R(y) = 0                                  if |y| <= L_max - L_cache
  R(y) = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
  R(y) = -1                                 if |y| > L_max

The penalty is added to the task's reward. With `cache_length` 0 it is a
hard -1 beyond `max_length` and 0 up to it.
"""

import jax.numpy as jnp
import numpy as np


def _check_whole(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"soft_overlong_penalty: {name}={value!r} must be a "
                     "whole number of tokens.")


def soft_overlong_penalty(lengths, max_length: int,
                          cache_length: int) -> jnp.ndarray:
  """The penalty of each response length (module docstring, DAPO eq. 13).

  Args:
    lengths: [batch] response lengths |y| in tokens (int or float).
    max_length: L_max, the length beyond which a response gets -1.
    cache_length: L_cache, the width of the band below L_max where the
      penalty falls linearly from 0 to -1; 0 <= cache_length <= max_length.

  Returns:
    [batch] float32 penalties in [-1, 0].
  """
  _check_whole("max_length", max_length)
  _check_whole("cache_length", cache_length)
  if max_length <= 0:
    raise ValueError(f"soft_overlong_penalty: max_length={max_length} must "
                     "be > 0.")
  if not 0 <= cache_length <= max_length:
    raise ValueError(f"soft_overlong_penalty: cache_length={cache_length} "
                     f"must be in [0, max_length={max_length}] (DAPO uses "
                     "L_max=20480, L_cache=4096).")
  lengths = jnp.asarray(lengths)
  if lengths.dtype == jnp.bool_ or not (
      jnp.issubdtype(lengths.dtype, jnp.integer)
      or jnp.issubdtype(lengths.dtype, jnp.floating)):
    raise ValueError("soft_overlong_penalty: lengths must be integer or "
                     f"float token counts, got dtype {lengths.dtype}.")
  lengths = lengths.astype(jnp.float32)
  free = float(max_length - cache_length)  # L_max - L_cache
  ramp = (free - lengths) / float(max(cache_length, 1))
  return jnp.where(lengths <= free, 0.0,
                   jnp.where(lengths <= max_length, ramp, -1.0)
                   ).astype(jnp.float32)
