"""Another run's network as a frozen network of this one: the one way a run
builds a trained reward model, whether it trains on its scores
(`rewards.reward_model`, online RL) or judges with them
(`eval.judge='reward_model'`), and a distillation teacher
(`distill.teacher_checkpoint`).

The network is built with its own run's model config (config.json beside
its checkpoints; a Hugging Face folder's config.json for a teacher), so it
may be larger than the policy or of the other architecture; it must read
the policy's vocabulary, which is checked when it is built, before
anything is written.
"""

import dataclasses
from typing import Any, Optional

import ml_collections

from jaxrlhf.models import pretrained
from jaxrlhf.models import scoring
from jaxrlhf.models import hf_io
from jaxrlhf.models.registry import build_model
from jaxrlhf.models.registry import module_for_config
from jaxrlhf.models.registry import padded_vocab_size


@dataclasses.dataclass(frozen=True)
class FrozenNetwork:
  """Another run's network (a reward model, a teacher), without its
  parameters.

  Attributes:
    path: its run's workdir (or a teacher's Hugging Face folder).
    adapter: its scoring adapter (`scoring.adapter_for` its Flax module).
    model_config: its model's dataclass config (`emb_dim` sizes a reward
      model's head).
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
          platform: str, check_vocabulary: bool = True,
          what: str = "the reward model",
          fix: str = "Train a reward model on the policy's vocabulary."
          ) -> FrozenNetwork:
  """The network of the run at `path`, named `field` in errors.

  Args:
    path: a jaxrlhf run's workdir (a reward_model run's for a reward
      model), or a Hugging Face folder.
    field: the config field that names it ("config.online.reward_model_
      checkpoint").
    policy_vocabulary: the vocabulary of the token ids it will score.
    fallback_model_config: the model config when `path` has no run config.
    platform: of the devices it runs on (`build_model`).
    check_vocabulary: False where no vocabulary file may be read (a plan).
    what, fix: the network and the remedy, in the vocabulary's error.
  """
  from jaxrlhf.data import vocab  # pylint: disable=g-import-not-at-top
  if pretrained.is_hf(path):
    return _hf_network(path, field, policy_vocabulary, what, fix)
  run = pretrained.run_config(path)
  trained = None
  if run and check_vocabulary:
    # The data stack loads here, where a vocabulary is read: not with the
    # config, nor in a plan.
    from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
    trained = tasks.run_vocabulary(run)
  if trained is not None:
    vocab.require_same(trained, policy_vocabulary,
                       f"{field}: {what} {path!r}", "the policy", fix)
  module, module_config = build_model(model_config(run, fallback_model_config),
                                      policy_vocabulary.vocab_size, platform)
  return FrozenNetwork(path, scoring.adapter_for(module), module_config)


def _hf_network(path, field, policy_vocabulary, what, fix) -> FrozenNetwork:
  """A Hugging Face folder's network, its config.json's model. Its
  tokenizer is not ours to read, so the check is the one its config
  allows: a vocabulary of another size is another vocabulary."""
  config = hf_io.config_from_hf(hf_io.read_hf_config(path))
  padded = padded_vocab_size(policy_vocabulary.vocab_size)
  if config.vocab_size not in (policy_vocabulary.vocab_size, padded):
    raise ValueError(
        f"{field}: {what} {path!r} reads a vocabulary of "
        f"{config.vocab_size} tokens, but the policy's has "
        f"{policy_vocabulary.vocab_size} (padded to {padded}), so its token "
        f"ids would be read as other tokens. {fix}")
  return FrozenNetwork(path, scoring.adapter_for(module_for_config(config)),
                       config)
