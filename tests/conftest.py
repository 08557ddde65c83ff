import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"


@pytest.fixture(scope="session")
def t5x_fixtures():
  path = FIXTURES / "t5x"
  assert path.is_dir(), f"shared fixtures not found at {path}: clone next to shared/"
  return path


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
