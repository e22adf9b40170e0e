import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Every Ray instance the tests start runs without token auth. A Ray driver fixes its auth mode
# at the first ray.init of the process and keeps it after ray.shutdown, and the two-node
# placement test needs auth off (a second `ray start` on one machine cannot join otherwise):
# with the default, that test failed whenever a test that starts a local cluster ran first.
os.environ["RAY_AUTH_MODE"] = "disabled"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random-weight Llama with grouped-query attention, saved as a HF directory."""
    from tests.factories import make_hf_model, save_hf_model

    model = make_hf_model("llama")
    return save_hf_model(model, tmp_path_factory.mktemp("tiny-llama")), model
