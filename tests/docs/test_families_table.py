"""docs/models.md's table of families is the registry's list (pdserve/engine/models/registry.py):
every architecture the engine serves has its row, and no row names one it does not."""

import re
from pathlib import Path

from pdserve.engine.models.registry import supported_architectures

MODELS_MD = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_the_families_table_lists_exactly_the_registrys_architectures():
    rows = re.findall(r"^\| `(\w+ForCausalLM)` \|", MODELS_MD.read_text(), flags=re.M)
    assert sorted(rows) == supported_architectures()
