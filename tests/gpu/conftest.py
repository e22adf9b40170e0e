"""Fixtures of the GPU check (tests/gpu/smol.py says what they build and why)."""

import pytest

from tests.gpu.smol import device_or_skip, save_smol


@pytest.fixture(scope="session")
def device():
    return device_or_skip()


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory, device):
    return save_smol(tmp_path_factory.mktemp("smol"))
