"""Shared fixtures: tiny random demo models built in code (no downloads)."""

import pytest
import torch

from diffrl.models.demo import DemoConfig, DemoFamily


def tiny_demo_config() -> DemoConfig:
    config = DemoConfig()
    config.transformer.update(num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
                              timestep_channels=16, axes_dims_rope=(2, 2, 2, 2))
    config.text_encoder.update(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    return config


@pytest.fixture
def tiny_family() -> DemoFamily:
    torch.manual_seed(0)
    return DemoFamily.build_random(tiny_demo_config(), seed=0)


@pytest.fixture
def tiny_model_dir(tmp_path, tiny_family):
    path = tmp_path / "tiny-demo"
    tiny_family.save(path)
    return path
