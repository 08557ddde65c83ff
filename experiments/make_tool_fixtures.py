"""Writes tests/fixtures/tool_schemas.json: transformers' own JSON schemas of
the test tools (tests/agent_tools.py's FIXTURE_TOOLS), the reference that
tests/test_agent_tools.py compares `jaxrlhf.agents.tools.tool_schema` to.

  pip install transformers   # get_json_schema needs no torch
  python experiments/make_tool_fixtures.py

The schemas are kept in transformers' key order: the template's `tojson`
writes them into the prompt in that order.
"""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "fixtures", "tool_schemas.json")


def main():
  sys.path.insert(0, os.path.join(REPO, "tests"))
  import agent_tools  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from transformers import utils as hf_utils

  fixture = {
      "source": ("transformers.utils.get_json_schema on tests/agent_tools.py"
                 "'s FIXTURE_TOOLS (experiments/make_tool_fixtures.py)"),
      "transformers_version": transformers.__version__,
      "schemas": {fn.__name__: hf_utils.get_json_schema(fn)
                  for fn in agent_tools.FIXTURE_TOOLS},
  }
  with open(OUT, "w") as f:
    json.dump(fixture, f, indent=2)
    f.write("\n")
  print(f"wrote {len(fixture['schemas'])} schemas to {OUT}")


if __name__ == "__main__":
  main()
