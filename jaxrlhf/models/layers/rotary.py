"""Rotary position embeddings: the rotation frequencies of a head's
channels (`rope_inverse_frequencies`, with Llama 3's or linear context
scaling, `RopeScaling`), the rotation itself (`apply_rotary_embedding`,
full or partial), and the positions of padded rows
(`positions_from_mask`)."""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import checks

Array = jax.Array


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


def positions_from_mask(attention_mask: Array) -> Array:
  """Positions for left- or right-padded rows: cumsum(mask) - 1, clipped at 0.

  Args:
    attention_mask: [batch, length], 1 = real token, 0 = pad.
  Returns:
    int32 [batch, length]; the first real token of each row is position 0.
  """
  mask = jnp.asarray(attention_mask).astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)
