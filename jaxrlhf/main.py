r"""Command-line entry point.

  python -m jaxrlhf.main --config=configs/quickstart.py --workdir=/tmp/run \
      --config.train.num_steps=1000

`--config` takes a config file (optionally `file.py:arg`) whose
`get_config()` returns an ml_collections ConfigDict; any field can be
overridden with `--config.a.b=value`. Running the same command again resumes
from the latest checkpoint in the workdir.
"""

import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (path[:arg]).", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, metrics and the resolved config.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False,
    "Join the other processes of a multi-host job with jax.distributed "
    "(auto-detected on TPU pods and GPU clusters).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0, for jax.distributed without auto-detection.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Number of processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_CPU_COLLECTIVES = flags.DEFINE_string(
    "cpu_collectives", None,
    "CPU collectives implementation for multi-process CPU runs, e.g. 'gloo'.")


def initialize_distributed():
  """Starts jax.distributed when asked; must run before any JAX computation."""
  import jax
  if _CPU_COLLECTIVES.value:
    jax.config.update("jax_cpu_collectives_implementation",
                      _CPU_COLLECTIVES.value)
  if _COORDINATOR.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  elif _DISTRIBUTED.value:
    jax.distributed.initialize()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # Imported here so that --help and flag errors are fast.
  import jax
  from jaxrlhf.train import loop

  logging.set_verbosity(logging.WARNING)
  initialize_distributed()
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/quickstart.py")
  try:
    if config.pipeline.stages:
      from jaxrlhf import offline_pipeline
      offline_pipeline.run(config, _WORKDIR.value)
      return
    summary = loop.train(config, _WORKDIR.value)
  except (ValueError, loop.NonFiniteError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  line = loop.gold_reward_line(summary)
  if line and jax.process_index() == 0:
    print(line, flush=True)


def _unknown_field_message(argv, error) -> str:
  """Names the --config.* override that refers to a missing field."""
  # ml_collections may append 'Did you mean "other" instead of "name"?' to
  # the missing name (inside a repr, so with escaped quotes and newline).
  text = str(error)
  suggestion = re.search(r'Did you mean "(\w+)" instead of "(\w+)"\?', text)
  if suggestion:
    missing = suggestion.group(2)
    hint = f' Did you mean "{suggestion.group(1)}"?'
  else:
    missing, hint = text.strip("\"' "), ""
  for arg in argv:
    if arg.startswith("--config."):
      path = arg[len("--config."):].split("=", 1)[0]
      parts = path.split(".")
      if missing in parts:
        parent = ".".join(parts[:parts.index(missing)]) or "config"
        return (f"error: unknown config field '{path}' (from {arg}): "
                f"'{parent}' has no field '{missing}'.{hint} The fields and "
                "their documentation are in jaxrlhf/defaults.py.")
  return f"error: bad config override: {missing}.{hint}"


def _parse_flags(argv):
  """absl's flag parsing, with a one-line error for unknown config fields."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    print(_unknown_field_message(argv, e), file=sys.stderr)
    sys.exit(1)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


def run():
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
