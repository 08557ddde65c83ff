"""The algorithms, registered once: `config.algorithm` names one of these.

Everything that lists algorithms derives from `REGISTRY`: the config's
allowed values and its per-algorithm groups (`jaxrlhf.defaults`), the
pipeline's stages (`jaxrlhf.offline_pipeline`) and the reference docs
(`python -m jaxrlhf.docs`). To add one, write its module (an `Algorithm`
value, `base.py`) and add its name to `MODULES`.
"""

import importlib
from typing import Dict, Tuple

from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import trainer

# The modules that define algorithms, in the order of the docs' table and
# the pipeline's stages: one line each. A module registers its `ALGORITHM`,
# or every value of its `ALGORITHMS` when it defines several.
MODULES = (
    "offline.sft",
    "offline.reward_model",
    "offline.dpo",
    "offline.tr_dpo",
    "offline.simpo",
    "offline.orpo",
    "offline.kto",
    "offline.bco",
    "offline.dro",
    "online.ppo",
    "online.rloo",
    "online.grpo",
    "online.reinforce",
    "online.reinforce_pp",
    "online.rejection_sampling",
    "online.distill",
)


def _algorithms_of(name: str) -> Tuple[base.Algorithm, ...]:
  module = importlib.import_module(f"jaxrlhf.algorithms.{name}")
  return getattr(module, "ALGORITHMS", None) or (module.ALGORITHM,)


REGISTRY: Dict[str, base.Algorithm] = {
    a.name: a for name in MODULES for a in _algorithms_of(name)}

NAMES: Tuple[str, ...] = tuple(REGISTRY)


def get(name: str) -> base.Algorithm:
  """The registered algorithm, or an error listing them."""
  if name not in REGISTRY:
    raise ValueError(f"config.algorithm: {name!r} is not one of {NAMES}.")
  return REGISTRY[name]


def config_groups():
  """Every algorithm's config groups, each once, in registry order."""
  seen = []
  for algorithm in REGISTRY.values():
    for group in algorithm.config_groups:
      if all(group is not g for g in seen):
        seen.append(group)
  return tuple(seen)


def check_rows(config, data_parallel: int) -> None:
  """`config.algorithm`'s batch splits: micro-batches, minibatches and data
  shards (its `Training.check_rows`)."""
  algorithm = get(config.algorithm)
  algorithm.training.check_rows(algorithm, config, data_parallel)


def build(config, mesh, workdir=None, shapes_only=False, evaluate=True):
  """The `Trainer` of `config.algorithm` on `mesh` (`shapes_only`: from the
  config alone, to compile its step without data; `evaluate=False`: one
  that never judges its policy; see `Trainer`)."""
  return trainer.Trainer(get(config.algorithm), config, mesh, workdir,
                         shapes_only=shapes_only, evaluate=evaluate)
