"""A trained jaxrlhf reward model as a frozen network: the one way a run
builds one, whether it trains on its scores (`rewards.reward_model`, online
RL) or judges with them (`eval.judge='reward_model'`).

The network is built with its own run's model config (config.json beside
its checkpoints), so it may be larger than the policy or of the other
architecture; it must read the policy's vocabulary, which is checked when
it is built, before anything is written.
"""

import dataclasses
from typing import Any, Optional

import ml_collections

from jaxrlhf.models import pretrained
from jaxrlhf.models import scoring
from jaxrlhf.models.registry import build_model


@dataclasses.dataclass(frozen=True)
class RewardModel:
  """A reward model's network, without its parameters.

  Attributes:
    path: its run's workdir.
    adapter: its scoring adapter (`scoring.adapter_for` its Flax module).
    model_config: its model's dataclass config (`emb_dim` sizes its head).
  """
  path: str
  adapter: Any
  model_config: Any


def model_config(run: Optional[dict], fallback) -> ml_collections.ConfigDict:
  """The `config.model` a reward model run was trained with: its own
  architecture and size. A run from before decoder-only models has no
  `arch` and was T5; a checkpoint without a run config takes `fallback`
  (the policy's)."""
  if not run or "model" not in run:
    return fallback
  config = ml_collections.ConfigDict(run["model"])
  if "arch" not in config:
    with config.unlocked():
      config.arch = "t5"
  return config


def build(path: str, field: str, policy_vocabulary, fallback_model_config,
          platform: str, check_vocabulary: bool = True) -> RewardModel:
  """The reward model of the run at `path`, named `field` in errors.

  Args:
    path: a jaxrlhf reward_model run's workdir.
    field: the config field that names it ("config.online.reward_model_
      checkpoint").
    policy_vocabulary: the vocabulary of the token ids it will score.
    fallback_model_config: the model config when `path` has no run config.
    platform: of the devices it runs on (`build_model`).
    check_vocabulary: False where no vocabulary file may be read (a plan).
  """
  from jaxrlhf.data import vocab  # pylint: disable=g-import-not-at-top
  run = pretrained.run_config(path)
  trained = None
  if run and check_vocabulary:
    # The data stack loads here, where a vocabulary is read: not with the
    # config, nor in a plan.
    from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
    trained = tasks.run_vocabulary(run)
  if trained is not None:
    vocab.require_same(
        trained, policy_vocabulary, f"{field}: the reward model {path!r}",
        "the policy", "Train a reward model on the policy's vocabulary.")
  module, module_config = build_model(model_config(run, fallback_model_config),
                                      policy_vocabulary.vocab_size, platform)
  return RewardModel(path, scoring.adapter_for(module), module_config)
