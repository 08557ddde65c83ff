"""Tool functions for tests/test_agent_tools.py, importable by path
("agent_tools:multiply"), and the functions whose schemas transformers
wrote into tests/fixtures/tool_schemas.json (`FIXTURE_TOOLS`,
experiments/make_tool_fixtures.py)."""

import enum
from typing import Any, Literal, Optional, Union


def multiply(a: int, b: int) -> int:
  """Multiplies two integers.

  Args:
    a: the first factor.
    b: the second factor.

  Returns:
    The product a * b.
  """
  return a * b


def search(query: str, max_results: Optional[int] = None,
           site: str = "") -> list[str]:
  """Searches a small offline index.

  Finds the documents whose text contains every word of the query,
  most relevant first.

  Args:
    query: the words to look for.
    max_results: at most this many results; all of them when None.
    site: only documents from this site
      (the host name, e.g. docs.python.org); '' for any.
  """
  return [f"{query}@{site or 'any'}"][:max_results]


def count_words(words: list[str], ignore_case: bool = True) -> dict[str, int]:
  """Counts how often each word occurs.

  Args:
    words: the words, one per item.
    ignore_case: count "The" and "the" as one word.
  """
  counts = {}
  for word in words:
    key = word.lower() if ignore_case else word
    counts[key] = counts.get(key, 0) + 1
  return counts


def convert_temperature(value: float, unit: Literal["celsius", "fahrenheit"],
                        precision: int = 1, style: str = "short") -> str:
  """Converts a temperature to the other unit.

  Args:
    value: the temperature.
    unit: the unit `value` is in.
    precision: digits after the decimal point.
    style: how to write the result (choices: ["short", "long"])
  """
  converted = (value * 9 / 5 + 32 if unit == "celsius"
               else (value - 32) * 5 / 9)
  suffix = ("F" if unit == "celsius" else "C") if style == "short" else (
      " degrees " + ("fahrenheit" if unit == "celsius" else "celsius"))
  return f"{converted:.{precision}f}{suffix}"


class Color(enum.Enum):
  RED = "red"
  GREEN = "green"


def paint(color: Color, area: Union[int, float], layers: tuple[int, str],
          options: Optional[dict[str, Any]] = None,
          label: Union[str, list[int], None] = None) -> None:
  """Paints a wall.

  Args:
    color: the paint's color.
    area: square meters.
    layers: (how many, which finish).
    options: anything else, by name.
    label: a name, or numbers.
  """
  del color, area, layers, options, label


def divide(a: float, b: float) -> float:
  """Divides a by b.

  Args:
    a: the dividend.
    b: the divisor.
  """
  return a / b


FIXTURE_TOOLS = (multiply, search, count_words, convert_temperature, paint,
                 divide)


# --- functions that are not tools (each refused by tool_schema) ---------------


def no_hint(a, b: int) -> int:
  """Adds.

  Args:
    a: one.
    b: two.
  """
  return a + b


def undocumented_argument(a: int, b: int) -> int:
  """Adds.

  Args:
    a: one.
  """
  return a + b


def no_docstring(a: int) -> int:
  return a


def bytes_argument(data: bytes) -> int:
  """Counts bytes.

  Args:
    data: the bytes.
  """
  return len(data)


NOT_A_TOOL = 42
