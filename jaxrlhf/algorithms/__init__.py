"""The algorithms, registered once: `config.algorithm` names one of these.

Everything that lists algorithms derives from `REGISTRY`: the config's
allowed values and its per-algorithm groups (`jaxrlhf.defaults`), the
pipeline's stages (`jaxrlhf.offline_pipeline`) and the reference docs
(`python -m jaxrlhf.docs`). To add one, write its module (an `Algorithm`
value, `base.py`) and add it here.
"""

from typing import Dict, Tuple

from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import dpo
from jaxrlhf.algorithms import dro
from jaxrlhf.algorithms import group_rl
from jaxrlhf.algorithms import kto
from jaxrlhf.algorithms import orpo
from jaxrlhf.algorithms import ppo
from jaxrlhf.algorithms import rejection_sampling
from jaxrlhf.algorithms import reward_model
from jaxrlhf.algorithms import sft
from jaxrlhf.algorithms import simpo
from jaxrlhf.algorithms import trainer

REGISTRY: Dict[str, base.Algorithm] = {a.name: a for a in (
    sft.ALGORITHM,
    reward_model.ALGORITHM,
    reward_model.RANKING,
    dpo.ALGORITHM,
    simpo.ALGORITHM,
    orpo.ALGORITHM,
    kto.ALGORITHM,
    kto.THUMBS,
    dro.ALGORITHM,
    ppo.ALGORITHM,
    group_rl.RLOO,
    group_rl.GRPO,
    group_rl.REINFORCE,
    rejection_sampling.ALGORITHM,
)}

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
  shards (`trainer.check_rows`)."""
  trainer.check_rows(get(config.algorithm), config, data_parallel)


def build(config, mesh, workdir=None, shapes_only=False):
  """The `Trainer` of `config.algorithm` on `mesh` (`shapes_only`: from the
  config alone, to compile its step without data; see `Trainer`)."""
  return trainer.Trainer(get(config.algorithm), config, mesh, workdir,
                         shapes_only=shapes_only)
