"""What the command-line programs share (`python -m jaxrlhf.main`,
`python -m jaxrlhf.plan`): the `--config` flag, `--help`, and one-line
errors.

A mistake in the command (an unknown flag or config field, a config file
that does not load, a value out of range) is one line starting with
"error:" on stderr and exit status `USAGE_ERROR`, never a traceback.

An override naming a field the config lacks is found before JAX is
imported when the config file needs no more of the library than
`defaults.base_config()` and modules that import nothing outside the
standard library (`presets`, `config_files`, `sharding_rules`,
`data.names`): the file is run against that config as the generated index
`config_index.py` records it (see `early_unknown_field`). Every committed
config takes this path.
"""

import contextlib
import copy
import importlib.abc
import os
import re
import sys
import traceback
import types
from typing import Callable, Optional, Sequence

from absl import flags
import ml_collections
from ml_collections import config_dict
from ml_collections import config_flags

from jaxrlhf import config_files
from jaxrlhf import config_index

# Exit status of a run refused for its command, config, workdir (held by
# another run, or its checkpoints written under another config) or input data
# (as argparse and absl use for usage errors); a run that fails while training
# (a non-finite step, a full disk, a lost process) exits 1.
USAGE_ERROR = 2



def _define_config_flag(flag_values: flags.FlagValues) -> flags.FlagHolder:
  return config_flags.DEFINE_config_file(
      "config", None, "Experiment config file (path[:arg]); required.",
      flag_values=flag_values, lock_config=True)


CONFIG = _define_config_flag(flags.FLAGS)


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


def _unknown_field_error(error: BaseException
                         ) -> Optional[BaseException]:
  """The AttributeError or KeyError behind a flag-parsing error that names
  a field the config lacks (ml_collections raises it bare or as a
  flags.Error's cause), or None."""
  if isinstance(error, (AttributeError, KeyError)):
    return error
  cause = error.__cause__ or error.__context__
  if isinstance(error, flags.Error) and isinstance(
      cause, (AttributeError, KeyError)):
    return cause
  return None


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
    missing = early_unknown_field(argv)
    if missing is not None:
      fail(unknown_field_message(argv, missing))
    try:
      return flags.FLAGS(argv)
    except Exception as e:  # pylint: disable=broad-except
      missing = _unknown_field_error(e)
      if missing is not None:
        fail(unknown_field_message(argv, missing))
      if isinstance(e, flags.Error):
        fail(str(e))
      # The config file itself failed while flags were parsed.
      fail(config_file_message(e))

  return parse


def no_arguments(argv) -> None:
  """Every setting is a flag: positional arguments are a one-line error."""
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}; every setting is a flag such "
         "as --config.train.num_steps=10.")


# Early check for overrides of missing fields.
#
# Loading a config imports the library (every algorithm declares its config
# group beside its code, and those modules import JAX), which is most of the
# time a typo in an override takes to report. The generated index holds what
# `defaults.base_config()` returns; a config file that needs nothing else of
# the library, or only modules of it that need nothing outside the standard
# library (the paper configs' `presets` and the constants it reads), can be
# run against it, and ml_collections then applies the overrides exactly as
# the full parse does. Whatever the index cannot stand in for (a module of
# any other package not yet imported, JAX included, whether the config file
# imports it or a module of the library does; another attribute of
# `defaults`) leaves the decision to the full parse, which runs next as it
# always did.

# The types a field of the index has, by the names the index gives them.
_TYPES = {t.__name__: t for t in (bool, int, float, str, tuple)}


class _Undecided(BaseException):
  """The index cannot stand in for what the config file needs. (Not an
  Exception, so that a config file's `except Exception` lets it through.)"""


def config_from_fields(fields) -> ml_collections.ConfigDict:
  """A ConfigDict from an index's fields: {group: {...}, field: (type
  name, default)}; a default of None is a placeholder of the type."""
  c = ml_collections.ConfigDict()
  for name, item in fields.items():
    if isinstance(item, dict):
      c[name] = config_from_fields(item)
    else:
      kind, default = item
      c[name] = (config_dict.placeholder(_TYPES[kind]) if default is None
                 else default)
  return c


def _override_paths(argv: Sequence[str]) -> Sequence[str]:
  """The field paths of argv's --config.<path> overrides, found as
  ml_collections finds them."""
  return [arg.split("=", 1)[0].split(".", 1)[1] for arg in argv
          if re.match(r"-{1,2}(no)?config\.", arg)]


def _missing_from_index(path: str) -> Optional[str]:
  """The first name of a dotted path the index lacks, or None."""
  node = config_index.FIELDS
  for name in path.split("."):
    if not isinstance(node, dict) or name not in node:
      return name
    node = node[name]
  return None


def _quoted_in_the_library(names: Sequence[str]) -> bool:
  """Whether the library's source holds any of `names` as a string: a
  field declared since the index was last generated does (by the time its
  author runs `python -m jaxrlhf.docs`, as tests/test_configs.py asks, the
  index has it), and the full parse must then decide."""
  pattern = re.compile("|".join(f"[\"']{re.escape(name)}[\"']"
                                for name in names))
  package = os.path.dirname(os.path.abspath(__file__))
  for folder, _, files in os.walk(package):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(folder, name), encoding="utf-8",
                  errors="replace") as f:
          if pattern.search(f.read()):
            return True
  return False


class _NothingUnloaded(importlib.abc.MetaPathFinder):
  """Refuses to import anything outside the standard library and this
  package, noting why in `refused` (in case the config file catches even
  _Undecided)."""

  def __init__(self, refused):
    self.refused = refused

  def find_spec(self, name, path=None, target=None):
    del path, target  # unused
    top = name.partition(".")[0]
    if top not in sys.stdlib_module_names and top != __package__:
      self.refused.append(f"the config file needs {name}")
      raise _Undecided(self.refused[-1])
    return None


@contextlib.contextmanager
def _library_from_index():
  """Within: `jaxrlhf.defaults` (unless already imported) is a stand-in
  whose attributes are `base_config()`, built from the index, and the
  names it shares with `config_files`; a module not yet imported can be
  imported only from the standard library or this package (whose modules
  are then refused what they import from elsewhere); anything else raises
  _Undecided, noted in the list it yields. Every change is undone on exit:
  the modules of this package imported within, which saw the stand-in, are
  forgotten, and the full parse imports them afresh."""
  refused = []
  package = sys.modules[__package__]
  module_name = f"{CONFIG.name}_config"  # where ml_collections loads it
  saved = {name: sys.modules.get(name)
           for name in (f"{__package__}.defaults", module_name)}
  before = set(sys.modules)
  if saved[f"{__package__}.defaults"] is None:
    stand_in = types.ModuleType(f"{__package__}.defaults")
    stand_in.base_config = lambda: config_from_fields(config_index.FIELDS)
    stand_in.PLACEHOLDER = config_files.PLACEHOLDER
    stand_in.load_config_file = config_files.load_config_file

    def other(name):
      if name.startswith("__"):
        raise AttributeError(name)
      refused.append(f"the config file uses defaults.{name}")
      raise _Undecided(refused[-1])

    stand_in.__getattr__ = other
    sys.modules[stand_in.__name__] = stand_in
    package.defaults = stand_in
  finder = _NothingUnloaded(refused)
  sys.meta_path.insert(0, finder)
  try:
    yield refused
  finally:
    sys.meta_path.remove(finder)
    for name in set(sys.modules) - before:
      if name.partition(".")[0] == __package__:
        _forget(name)
    for name, module in saved.items():
      if module is None:
        _forget(name)
      else:
        sys.modules[name] = module


def _forget(name: str) -> None:
  """Removes module `name` from sys.modules and from its parent package's
  attributes (where `from package import name` would find it first)."""
  module = sys.modules.pop(name, None)
  parent, _, child = name.rpartition(".")
  if module is not None and parent in sys.modules and (
      vars(sys.modules[parent]).get(child) is module):
    del vars(sys.modules[parent])[child]


def early_unknown_field(argv: Sequence[str]) -> Optional[BaseException]:
  """The error the full parse of argv would raise for an override naming a
  field the config lacks, found without importing the library; None when
  every override is in the index, when there is no such error, or when the
  index cannot tell (a missing name the library's source quotes, a config
  file that needs more than the index): the full parse then decides.

  argv is parsed by a copy of every flag, with the config file run under
  `_library_from_index`: the same overrides are applied in the same order
  to a config of the same fields and types, so the first error is the one
  the full parse meets first."""
  missing = [name for name in map(_missing_from_index, _override_paths(argv))
             if name is not None]
  if not missing or _quoted_in_the_library(missing):
    return None  # Nothing to find early, or the index may be behind.
  scratch = flags.FlagValues()
  for flag in {id(flags.FLAGS[n]): flags.FLAGS[n] for n in flags.FLAGS
               }.values():
    # (Not the config flag, nor the override flags an earlier parse made.)
    if flag.name.split(".")[0] != CONFIG.name:
      scratch[flag.name] = copy.deepcopy(flag)
  _define_config_flag(scratch)
  parser = scratch[CONFIG.name].parser
  loaded = []  # set once get_config() has returned

  def load(path):
    config = type(parser).parse(parser, path)
    loaded.append(path)
    return config

  parser.parse = load
  with _library_from_index() as refused:
    try:
      scratch(list(argv))
      return None
    except _Undecided:
      return None
    except Exception as e:  # pylint: disable=broad-except
      error = e
  # An error before get_config() returned is the config file's own, which
  # the full parse reports (it may differ under the stand-in).
  if refused or not loaded:
    return None
  return _unknown_field_error(error)
