import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"


@pytest.fixture(scope="session")
def t5x_fixtures():
  path = FIXTURES / "t5x"
  if not path.is_dir():
    pytest.skip(f"shared fixtures not found at {path}")
  return path
