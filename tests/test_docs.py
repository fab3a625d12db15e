"""The documentation names what users can reach: every public name of ``rlt_compile``, every
environment variable the package reads, and every ``python -m`` entry point the docs mention."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import rlt_compile
from rlt_compile import envs

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_public_name_is_in_the_api_docs():
    api = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in rlt_compile.__all__ if f"`{name}" not in api and f"{name}(" not in api]
    assert not missing, f"docs/api.md does not mention {missing}"


def test_every_environment_variable_has_a_row_in_the_knobs_table():
    table = (ROOT / "docs" / "rocm.md").read_text().split("## Environment knobs", 1)[1]
    rows = set(re.findall(r"^\| `([A-Z_]+)` \|", table, flags=re.M))
    assert set(envs.ENV_VARS) <= rows, f"missing rows: {sorted(set(envs.ENV_VARS) - rows)}"


def test_every_entry_point_the_docs_name_exists():
    named = {m for doc in DOCS for m in re.findall(r"python3? -m (rlt_compile(?:\.\w+)+)", doc.read_text())}
    assert "rlt_compile.generate" in named  # the pattern still finds them
    missing = [m for m in sorted(named) if importlib.util.find_spec(m) is None]
    assert not missing, f"the docs name modules that do not exist: {missing}"
