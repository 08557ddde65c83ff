import gc
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
# The tests' models are tiny: compiling their steps costs far more than
# running them, so XLA skips LLVM's expensive optimisations here (a third less
# CPU in the suite) and emits fusions the older way (without the new fusion
# emitters, which compile slower: a third less CPU again in the tests that
# train). Floating-point results may differ from an optimised build in the
# last bits, which no test depends on: exact comparisons are between two runs
# under the same flags, fixtures are compared with tolerances.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 "
                  "--xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                           + TEST_XLA_FLAGS).strip()
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


def synthetic_feedback_file(directory, kind, count=32,
                            completions=("ideal", "targets"), **kwargs):
  """A JSONL file of labelled feedback of `kind` ("pairs", "trajectory",
  ...) on the first `count` training prompts of the synthetic task, from
  the completions named (fields of its examples), judged by the gold reward
  (`synthetic_feedback.write_synthetic_feedback`; kwargs such as beta go
  there). Returns its path."""
  from jaxrlhf.data import synthetic  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import synthetic_feedback  # pylint: disable=g-import-not-at-top
  examples = synthetic.make_examples("train", count)
  path = os.path.join(str(directory), f"{kind}.jsonl")
  synthetic_feedback.write_synthetic_feedback(
      path, kind, [e["inputs"] for e in examples],
      [[e[c] for c in completions] for e in examples], synthetic.gold_reward,
      **kwargs)
  return path


def one_device_mesh(config):
  """(mesh of the first device, the config's logical-axis rules)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  return mesh, sharding.as_rules(config.sharding.logical_axis_rules)


def quiet_env(optimised_xla=False, **extra):
  """The environment of a subprocess: this one's (compilation cache and XLA
  flags included), on the CPU, with `extra`; extra XLA_FLAGS are added to
  the suite's. `optimised_xla` leaves out TEST_XLA_FLAGS, for a long run
  whose steps cost more than their compilation: the quickstart's pipeline
  takes a third less CPU with XLA's usual optimisations (its results are
  the same), while the whole suite under them takes a quarter more."""
  env = dict(os.environ)
  env.update({"TF_CPP_MIN_LOG_LEVEL": "3", "JAX_PLATFORMS": "cpu"})
  extra = dict(extra)
  xla_flags = [env["XLA_FLAGS"].replace(TEST_XLA_FLAGS, ""),
               "" if optimised_xla else TEST_XLA_FLAGS,
               extra.pop("XLA_FLAGS", "")]
  env["XLA_FLAGS"] = " ".join(f.strip() for f in xla_flags if f.strip())
  env.update(extra)
  return env


def tiny_llama(vocab_size: int, scale: float = 1.0):
  """(module, params) of the "tiny" Llama preset with `vocab_size` ids,
  seeded with key 3, its weights (numpy) times `scale` (2: peakier
  next-token distributions, clear greedy margins): the decode tests' model."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models import llama  # pylint: disable=g-import-not-at-top
  model = llama.Llama(llama.LlamaConfig.preset("tiny", vocab_size=vocab_size))
  one = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(
      jax.jit(model.init)(jax.random.PRNGKey(3), one, one, one)["params"])
  return model, jax.tree.map(lambda x: np.array(x * scale), params)


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


# The modules of the longest tests, started first (the suite runs with
# `--dist loadscope`: a module's tests share one worker, so its module-scoped
# fixtures run once): two workers then finish together instead of one of
# them starting a five-minute test when the rest is done.
LONGEST_FIRST = ("test_quickstart.py", "test_eight_devices.py",
                 "test_launch_clusters.py", "test_distributed.py",
                 "test_training.py", "test_faults.py", "test_configs.py")


def pytest_configure(config):
  # pytest-xdist reorders loadscope modules by their number of tests unless
  # told not to, which started the quickstart's one long run last.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_finish(session):
  # The test modules have imported TensorFlow, JAX and seqio: half a million
  # objects that live as long as the worker. The garbage collector leaves
  # them out of its passes (as jaxrlhf.main does), or every full pass of a
  # test walks them all.
  del session
  gc.freeze()


def pytest_sessionfinish(session, exitstatus):
  # An xdist worker is stopped with KeyboardInterrupt; landing in JAX's
  # garbage-collection callback, it printed a traceback per worker as an
  # "unraisable exception". The tests are done: JAX need not collect.
  del session, exitstatus
  gc.callbacks[:] = [c for c in gc.callbacks
                     if getattr(c, "__name__", "") != "_xla_gc_callback"]


def pytest_collection_modifyitems(session, config, items):
  """Orders whole modules (a module's tests stay together and in their order,
  or pytest would set its module fixtures up again)."""
  del session, config

  def rank(item):
    module = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
    return (LONGEST_FIRST.index(module) if module in LONGEST_FIRST
            else len(LONGEST_FIRST))

  items.sort(key=rank)  # stable: the rest keep their order
