import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# One persistent XLA compilation cache for the test session: its workers and
# the subprocesses they start (which inherit the environment) compile each
# distinct computation once. Most tests train the same tiny models, so most
# compilations repeat; a cached executable is the one XLA compiled for the
# same program, so no number changes. Kept between sessions, like pytest's
# own cache beside it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(REPO / ".pytest_cache" / "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture(scope="session")
def t5x_fixtures():
  """Checkpoints written by t5x and t5x's outputs for them (see the README
  in that folder)."""
  return FIXTURES / "t5x"


# A model and run small enough for many end-to-end runs on 2 CPU cores.
TINY_OVERRIDES = {
    "model.emb_dim": 32, "model.num_heads": 2, "model.head_dim": 16,
    "model.mlp_dim": 64, "model.num_encoder_layers": 1,
    "model.num_decoder_layers": 1, "train.batch_size": 16,
    "train.log_every": 1, "eval.num_examples": 16, "eval.batch_size": 16,
    "optimizer.learning_rate": 1e-2,
    # A single run of config.algorithm, not the quickstart's whole pipeline.
    "pipeline.stages": "",
}


def tiny_config(**overrides):
  """The quickstart config with TINY_OVERRIDES and `overrides` applied;
  keys are dotted paths with "." replaced by "__" (model__emb_dim=64)."""
  from jaxrlhf import defaults
  config = defaults.load_config_file(REPO / "configs" / "quickstart.py")
  merged = dict(TINY_OVERRIDES)
  merged.update({k.replace("__", "."): v for k, v in overrides.items()})
  defaults.apply_overrides(config, merged)
  return config


def cli_args(**overrides):
  """--config.x=y flags for TINY_OVERRIDES plus `overrides` (as tiny_config)."""
  merged = dict(TINY_OVERRIDES)
  merged.update({k.replace("__", "."): v for k, v in overrides.items()})
  return [f"--config.{k}={v}" for k, v in merged.items()]


def quiet_env(**extra):
  env = dict(os.environ)
  env.update({"TF_CPP_MIN_LOG_LEVEL": "3", "JAX_PLATFORMS": "cpu"})
  env.update(extra)
  return env


def from_scratch(algorithm):
  """`algorithm` whose networks start from their seeded initialisation: no
  checkpoint is read."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.replace(algorithm, networks=dataclasses.replace(
      algorithm.networks, checkpoints=lambda trainer: {}))


def evaluated_by(algorithm, evaluate=lambda trainer, state: {}):
  """`algorithm` with another evaluation (by default none)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from jaxrlhf.algorithms import base  # pylint: disable=g-import-not-at-top
  return dataclasses.replace(algorithm, evaluation=base.Evaluation(
      evaluate=evaluate, describe=lambda trainer: "a test's evaluation"))


def trainer_of(algorithm, config, mesh, workdir=None):
  """A trainer for `algorithm` (a registered one, or one changed by
  `from_scratch` / `evaluated_by`)."""
  from jaxrlhf.algorithms import trainer  # pylint: disable=g-import-not-at-top
  return trainer.Trainer(algorithm, config, mesh, workdir)
