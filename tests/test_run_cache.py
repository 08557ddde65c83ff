"""`run_cache.per_run`: a value computed the first time a run asks for it,
per run and key, and never again for that run."""

from jaxrlhf import run_cache


class Run:
  pass


def test_a_value_is_computed_once_per_run_and_key():
  calls = []

  @run_cache.per_run
  def read(run, split, *, scale=1):
    calls.append((run, split, scale))
    return f"{split} x {scale}"

  first, second = Run(), Run()
  assert read(first, "train", scale=2) == "train x 2"
  # Inputs feed the first call only: the value stays the run's.
  assert read(first, "train", scale=3) == "train x 2"
  assert read(first, "validation") == "validation x 1"
  assert read(second, "train") == "train x 1"
  assert calls == [(first, "train", 2), (first, "validation", 1),
                   (second, "train", 1)]


def test_functions_of_the_same_run_keep_their_own_values():
  @run_cache.per_run
  def one(run):
    return 1

  @run_cache.per_run
  def two(run):
    return 2

  run = Run()
  assert (one(run), two(run), one(run)) == (1, 2, 1)
