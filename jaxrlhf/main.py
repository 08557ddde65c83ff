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

import os
import re
import sys
import traceback

from absl import app
from absl import flags
from ml_collections import config_flags

from jaxrlhf import console

# Exit status of a run refused for its command, config, workdir (held by
# another run, or its checkpoints written under another config) or input data
# (as argparse and absl use for usage errors); a run that fails while training
# (a non-finite step, a full disk, a lost process) exits 1.
USAGE_ERROR = 2

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (path[:arg]); required.",
    lock_config=True)
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


def _fail(message: str) -> None:
  """One line on stderr and the usage-error exit status."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


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


def _loaded_config():
  """The --config value, or a one-line error naming the file and why."""
  try:
    config = _CONFIG.value
    if config is not None:
      # A file that failed to load gives a placeholder that raises on use.
      config.keys()
  except Exception as e:  # pylint: disable=broad-except
    _fail(_config_file_message(e))
  if config is None:
    _fail("--config is required, e.g. --config=configs/quickstart.py")
  return config


def _config_file_message(error: BaseException) -> str:
  """What went wrong with which config file, in one line (ml_collections
  wraps a config file's failure in up to three chained errors)."""
  # The last --config= wins, as in absl.
  path = ([a.split("=", 1)[1] for a in sys.argv
           if a.startswith("--config=")] or ["?"])[-1]
  chain = [error]
  while chain[-1].__cause__ or chain[-1].__context__:
    chain.append(chain[-1].__cause__ or chain[-1].__context__)
  if any("No such file" in str(e) or "Errno 2" in str(e) for e in chain):
    return (f"--config={path}: no such file. The experiment configs are in "
            "configs/, e.g. --config=configs/quickstart.py.")
  cause = next((e for e in chain if isinstance(e, SyntaxError)), chain[-1])
  if isinstance(cause, SyntaxError):
    where = f" (line {cause.lineno})" if cause.lineno else ""
    return f"--config={path}: SyntaxError: {cause.msg}{where}."
  file = path.split(":", 1)[0]
  lines = [f.lineno for f in traceback.extract_tb(cause.__traceback__)
           if os.path.abspath(f.filename) == os.path.abspath(file)]
  where = f" (line {lines[-1]})" if lines else ""
  detail = str(cause).strip().splitlines()
  return (f"--config={path}: get_config raised {type(cause).__name__}"
          f"{': ' + detail[-1] if detail else ''}{where}.")


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}; every setting is a flag such "
          "as --config.train.num_steps=10.")
  config = _loaded_config()
  # Imported here so that --help and flag errors are fast.
  from absl import logging  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  logging.set_verbosity(logging.ERROR)
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf.train import loop  # pylint: disable=g-import-not-at-top
  initialize_distributed(config)
  try:
    if config.pipeline.stages:
      from jaxrlhf import offline_pipeline  # pylint: disable=g-import-not-at-top
      offline_pipeline.run(config, _WORKDIR.value)
      return
    summary = loop.train(config, _WORKDIR.value)
  except (loop.NonFiniteError, loop.WriteError) as e:
    # The run failed while training (a non-finite step, a full disk): its
    # last complete checkpoint is kept, and running again resumes.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except ValueError as e:
    _fail(str(e))
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
        return (f"unknown config field '{path}' (from {arg}): "
                f"'{parent}' has no field '{missing}'.{hint} The fields and "
                "their documentation are in jaxrlhf/defaults.py.")
  return f"bad config override: {missing}.{hint}"


def usage() -> str:
  """--help: the module docstring and our flags (absl's own help lists
  every library's flags and shows --config's default as 'None')."""
  lines = [__doc__.strip(), "", "flags:"]
  for name in _OUR_FLAGS:
    flag = flags.FLAGS[name]
    kind = "" if flag.boolean else "=..."
    lines.append(f"  --{name}{kind}")
    lines.append(f"      {flag.help}")
  lines.append("  --config.<field>=value")
  lines.append("      Override one field of the config (see "
               "jaxrlhf/defaults.py for every field and its meaning).")
  return "\n".join(lines)


def _parse_flags(argv):
  """absl's flag parsing, with one-line errors and --help that exits 0."""
  if any(a in ("--help", "-h", "--helpfull", "--helpshort", "-?")
         for a in argv[1:]):
    print(usage())
    sys.exit(0)
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    _fail(_unknown_field_message(argv, e))
  except flags.Error as e:
    if isinstance(e.__cause__ or e.__context__, (AttributeError, KeyError)):
      _fail(_unknown_field_message(argv, e.__cause__ or e.__context__))
    _fail(str(e))
  except Exception as e:  # pylint: disable=broad-except
    # The config file itself failed while flags were parsed.
    _fail(_config_file_message(e))


def run():
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
