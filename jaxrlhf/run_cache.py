"""Values a run computes the first time it asks for them, then reuses:
held-out examples read for evaluation, functions compiled for it, a judge's
network loaded, the frozen reference's scores of fixed data.

`per_run` marks such a function, so that what depends on what stays a plain
function call (`eval_split_features(trainer)`), with no string keys: the first
call for a run computes the value, and it is kept on the run object (for as
long as the run lives; a pipeline's next stage is another run).

    @per_run
    def eval_prompts(trainer, split):
      ...  # read once per run and split
"""

import functools

_STORE = "_per_run_values"


def per_run(fn):
  """`fn(run, *keys, **inputs)`, computed once per run and `keys`.

  `keys` are hashable (a split's name) and tell values apart; `inputs`
  (parameters, arrays) feed the first call only, for a value that by its
  nature does not change during the run (the frozen reference's log-probs
  of held-out data)."""

  @functools.wraps(fn)
  def cached(run, *keys, **inputs):
    store = run.__dict__.setdefault(_STORE, {})
    key = (fn.__module__, fn.__qualname__) + keys
    if key not in store:
      store[key] = fn(run, *keys, **inputs)
    return store[key]

  return cached
