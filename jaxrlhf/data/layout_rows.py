"""What every row layout (`file_layouts`, `chat_layouts`) works with: the
context a row is parsed in, the examples it yields, the columns it reads.
"""

import dataclasses
import functools
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Union

import numpy as np

from jaxrlhf.data import alignment_kinds as kinds_lib
from jaxrlhf.data import chat_templates
from jaxrlhf.data import row_checks

BadRow = row_checks.BadRow
# The key of an example's extra columns ({name: value}), beside its fields.
EXTRA_COLUMNS = "extra_columns"


@dataclasses.dataclass
class RowContext:
  """What a layout may use to turn one row into examples."""
  kind: kinds_lib.DataKind
  column_mapping: Mapping[str, str]
  options: Mapping[str, Any]
  # Tokens of a prompt as the task will hold it (EOS included if appended);
  # None when no vocabulary was given.
  prompt_tokens: Optional[Callable[[str], int]]
  max_prompt_tokens: Optional[int]
  rng_factory: Callable[[], np.random.Generator]
  # Layout "columns", demonstrations: extra column name -> file column.
  extra_columns: Mapping[str, str] = dataclasses.field(default_factory=dict)
  # Layout "messages": the template conversations are rendered with.
  chat_template: Optional[chat_templates.ChatTemplate] = None

  @functools.cached_property
  def rng(self) -> np.random.Generator:
    return self.rng_factory()


RowResult = Iterator[Union[dict, BadRow]]


def get_path(record: Mapping[str, Any], column: str):
  """record[column], following dots into nested objects; None if absent."""
  value = record
  for part in column.split("."):
    if not isinstance(value, Mapping) or part not in value:
      return None
    value = value[part]
  return value


def extra_values(record, ctx: RowContext) -> Union[Dict[str, Any], BadRow]:
  """The row's values of the extra columns a column mapping names."""
  extras = {}
  for name, column in ctx.extra_columns.items():
    value = get_path(record, column)
    if value is None:
      return BadRow("missing_field", f"column {column!r} (extra column "
                    f"{name!r}) is missing or null.")
    extras[name] = value
  return extras


def column(ctx: RowContext, name: str) -> str:
  """The file column a layout reads for `name` (its mapping, or itself)."""
  return ctx.column_mapping.get(name, name)
