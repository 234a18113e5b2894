"""Shared fixtures: tiny random demo models built in code (no downloads)."""

import pytest
import torch

from diffrl.models.demo import DemoFamily
from diffrl.models.random_checkpoints import demo as random_demo


@pytest.fixture
def tiny_family() -> DemoFamily:
    torch.manual_seed(0)
    return random_demo.random_family(random_demo.tiny(), seed=0)


@pytest.fixture
def tiny_model_dir(tmp_path, tiny_family):
    path = tmp_path / "tiny-demo"
    tiny_family.save(path)
    return path
