"""What the command-line programs share (`python -m jaxrlhf.main`,
`python -m jaxrlhf.plan`): the `--config` flag, `--help`, and one-line
errors.

A mistake in the command (an unknown flag or config field, a config file
that does not load, a value out of range) is one line starting with
"error:" on stderr and exit status `USAGE_ERROR`, never a traceback.
"""

import os
import re
import sys
import traceback
from typing import Callable, Sequence

from absl import flags
from ml_collections import config_flags

# Exit status of a run refused for its command, config, workdir (held by
# another run, or its checkpoints written under another config) or input data
# (as argparse and absl use for usage errors); a run that fails while training
# (a non-finite step, a full disk, a lost process) exits 1.
USAGE_ERROR = 2

CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (path[:arg]); required.",
    lock_config=True)


def fail(message: str) -> None:
  """One line on stderr and the usage-error exit status."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def loaded_config():
  """The --config value, or a one-line error naming the file and why."""
  try:
    config = CONFIG.value
    if config is not None:
      # A file that failed to load gives a placeholder that raises on use.
      config.keys()
  except Exception as e:  # pylint: disable=broad-except
    fail(config_file_message(e))
  if config is None:
    fail("--config is required, e.g. --config=configs/quickstart.py")
  return config


def config_file_message(error: BaseException) -> str:
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


def unknown_field_message(argv, error) -> str:
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


def usage(doc: str, flag_names: Sequence[str]) -> str:
  """--help: a program's docstring and its flags (absl's own help lists
  every library's flags and shows --config's default as 'None')."""
  lines = [doc.strip(), "", "flags:"]
  for name in flag_names:
    flag = flags.FLAGS[name]
    kind = "" if flag.boolean else "=..."
    lines.append(f"  --{name}{kind}")
    lines.append(f"      {flag.help}")
  lines.append("  --config.<field>=value")
  lines.append("      Override one field of the config (see "
               "jaxrlhf/defaults.py for every field and its meaning).")
  return "\n".join(lines)


def flags_parser(help_text: Callable[[], str]):
  """absl's flag parsing for `app.run(flags_parser=...)`, with one-line
  errors and a --help (printing `help_text()`) that exits 0."""

  def parse(argv):
    if any(a in ("--help", "-h", "--helpfull", "--helpshort", "-?")
           for a in argv[1:]):
      print(help_text())
      sys.exit(0)
    try:
      return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:
      fail(unknown_field_message(argv, e))
    except flags.Error as e:
      if isinstance(e.__cause__ or e.__context__, (AttributeError, KeyError)):
        fail(unknown_field_message(argv, e.__cause__ or e.__context__))
      fail(str(e))
    except Exception as e:  # pylint: disable=broad-except
      # The config file itself failed while flags were parsed.
      fail(config_file_message(e))

  return parse


def no_arguments(argv) -> None:
  """Every setting is a flag: positional arguments are a one-line error."""
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}; every setting is a flag such "
         "as --config.train.num_steps=10.")
