import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random-weight Llama with grouped-query attention, saved as a HF directory."""
    from tests.factories import make_hf_model, save_hf_model

    model = make_hf_model("llama")
    return save_hf_model(model, tmp_path_factory.mktemp("tiny-llama")), model
