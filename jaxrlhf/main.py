r"""Command-line entry point.

  python -m jaxrlhf.main --config=configs/quickstart.py --workdir=/tmp/run \
      --config.train.num_steps=1000

`--config` takes a config file (optionally `file.py:arg`) whose
`get_config()` returns an ml_collections ConfigDict; any field can be
overridden with `--config.a.b=value`. Running the same command again resumes
from the latest checkpoint in the workdir.

A mistake in the command (an unknown flag or config field, a config file that
does not load, a value out of range, a path that does not exist) is one line
starting with "error:" on stderr and exit status 2, before anything is
written to the workdir.
"""

import gc
import sys

from absl import app
from absl import flags

from jaxrlhf import cli
from jaxrlhf import console

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, metrics and the resolved "
    "config; required.")
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

_OUR_FLAGS = ("config", "workdir", "distributed", "coordinator_address",
              "num_processes", "process_id", "cpu_collectives")


def initialize_distributed(config):
  """Starts jax.distributed when asked; must run before any JAX computation.
  JAX's heartbeat timeout is set above config.train.lost_process_timeout_s,
  so that a lost process is reported by the run in one line
  (jaxrlhf.train.peers)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf.train import peers  # pylint: disable=g-import-not-at-top
  if _CPU_COLLECTIVES.value:
    jax.config.update("jax_cpu_collectives_implementation",
                      _CPU_COLLECTIVES.value)
  # (An invalid value is refused, naming the field, once the run starts.)
  timeout = max(config.train.lost_process_timeout_s, 1)
  if _COORDINATOR.value:
    peers.initialize(coordinator_address=_COORDINATOR.value,
                     num_processes=_NUM_PROCESSES.value,
                     process_id=_PROCESS_ID.value,
                     lost_process_timeout_s=timeout)
  elif _DISTRIBUTED.value:
    peers.initialize(lost_process_timeout_s=timeout)


def main(argv):
  cli.no_arguments(argv)
  config = cli.loaded_config()
  # Imported here so that --help and flag errors are fast.
  from absl import logging  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  logging.set_verbosity(logging.ERROR)
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
  from jaxrlhf.train import loop  # pylint: disable=g-import-not-at-top
  # The imports made half a million objects (TensorFlow, JAX, seqio) that
  # live as long as the process: the garbage collector, paused while they
  # were made (`run`), leaves them out of its passes from here on. Each full
  # pass walked them all, and the one at exit took seconds.
  gc.freeze()
  gc.enable()
  initialize_distributed(config)
  try:
    if config.pipeline.stages:
      offline_pipeline.run(config, _WORKDIR.value)
      return
    summary = loop.train(config, _WORKDIR.value)
  except (loop.NonFiniteError, loop.WriteError,
          loop.RewardFunctionError) as e:
    # The run failed while training (a non-finite step, a full disk, a
    # reward function that failed on a row): its last complete checkpoint
    # is kept, and running again resumes.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except ValueError as e:
    cli.fail(str(e))
  line = loop.gold_reward_line(summary)
  if line and jax.process_index() == 0:
    print(line, flush=True)


def run():
  # No garbage collection while the modules load (in the flags' parsing,
  # which loads the config file, and in `main`): its passes would only walk
  # the objects the imports keep (a config error took 6.4-7.8 CPU seconds
  # with them, 5.7-5.9 without). `main` resumes it.
  gc.disable()
  app.run(main, flags_parser=cli.flags_parser(
      lambda: cli.usage(__doc__, _OUR_FLAGS)))


if __name__ == "__main__":
  run()
