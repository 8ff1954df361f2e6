"""docs/config.md is generated from the schema; it must match the code exactly."""
from __future__ import annotations

import dataclasses
import pathlib

from adacomp.tools import config_doc
from adacomp.config import Config

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "config.md"


def test_config_doc_is_up_to_date() -> None:
    assert DOC.read_text() == config_doc.render(), "run: python -m adacomp.tools.config_doc > docs/config.md"


def test_every_key_has_an_explanation() -> None:
    paths = [row[0] for row in config_doc._fields(Config, "")]
    missing = [p for p in paths if p not in config_doc.KEY_DOCS]
    assert not missing, missing
    assert {f.name for f in dataclasses.fields(Config)} <= set(paths)
