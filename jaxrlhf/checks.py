"""Argument checks shared by the losses, the RL functions and the models.

They run on static shapes and Python values at trace time, so they cost
nothing under jit and fail before any compilation with a message that says
where and what to change.
"""

import numpy as np


def check_choice(where: str, name: str, value, choices) -> None:
  """Raises ValueError unless `value` is one of `choices`."""
  if value not in tuple(choices):
    raise ValueError(f"{where}: {name}={value!r} is not supported; choose one "
                     f"of {list(choices)}.")


def check_same_shape(where: str, **arrays) -> None:
  """Raises ValueError listing the shapes unless all (non-None) agree."""
  shapes = {name: tuple(np.shape(x)) for name, x in arrays.items()
            if x is not None}
  if len(set(shapes.values())) > 1:
    listed = ", ".join(f"{name}{list(shape)}" for name, shape in shapes.items())
    raise ValueError(f"{where}: shapes must match, got {listed}.")


def check_rank(where: str, name: str, x, rank: int, hint: str = "") -> None:
  """Raises ValueError unless `x` has `rank` dimensions."""
  if np.ndim(x) != rank:
    raise ValueError(f"{where}: `{name}` must have rank {rank}, got shape "
                     f"{tuple(np.shape(x))}" + (f"; {hint}" if hint else "."))


def check_groups(where: str, num_samples: int, group_size: int) -> None:
  """Samples of one prompt are adjacent: [prompt0 x k, prompt1 x k, ...]."""
  if group_size < 1 or num_samples % group_size:
    raise ValueError(
        f"{where}: batch of {num_samples} samples is not a whole number of "
        f"groups of group_size={group_size}. Lay the batch out as "
        "[num_prompts * group_size] with the samples of each prompt adjacent.")
