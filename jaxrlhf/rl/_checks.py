"""Shape and argument checks shared by the RL functions.

They run on static shapes at trace time, so they cost nothing under jit and
fail before any compilation with a message that says what to change.
"""


def check_same_shape(where, **arrays):
  """Raises ValueError unless every named array has the same shape."""
  shapes = {name: tuple(a.shape) for name, a in arrays.items()}
  if len(set(shapes.values())) > 1:
    listed = ", ".join(f"{name}{list(shape)}" for name, shape in shapes.items())
    raise ValueError(
        f"{where}: shapes differ: {listed}. All of them must be "
        "[batch, length] over the same response tokens.")


def check_rank(where, name, array, rank):
  if array.ndim != rank:
    raise ValueError(
        f"{where}: {name} has shape {list(array.shape)} (rank {array.ndim}); "
        f"expected rank {rank}.")


def check_choice(where, name, value, choices):
  if value not in choices:
    raise ValueError(
        f"{where}: unknown {name}={value!r}; choose one of {sorted(choices)}.")


def check_groups(where, num_samples, group_size):
  """Samples of one prompt are adjacent: [prompt0 x k, prompt1 x k, ...]."""
  if group_size < 1 or num_samples % group_size:
    raise ValueError(
        f"{where}: batch of {num_samples} samples is not a whole number of "
        f"groups of group_size={group_size}. Lay the batch out as "
        "[num_prompts * group_size] with the samples of each prompt adjacent.")
