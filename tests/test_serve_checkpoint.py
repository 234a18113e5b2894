"""`diffrl serve --checkpoint`: a trained run's model (LoRA on its base, or full weights) behind the engine."""

import pytest
import torch

from diffrl.cli.main import parse
from diffrl.engine.engine import Engine
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import ServeConfig, build_engine
from diffrl.models.checkpoint import load_model
from diffrl.train.trainer import Trainer
from test_trainer import tiny_config


def _images(engine):
    request = RolloutRequest(prompt="a red circle", seed=3, num_outputs_per_prompt=2, num_inference_steps=2)
    return torch.stack([o.generated_output for o in engine.generate(request)])


@pytest.mark.parametrize("use_lora", [False, True])
def test_serve_a_run_checkpoint(tiny_model_dir, tmp_path, use_lora):
    run = tmp_path / "run"
    trainer = Trainer(tiny_config(tiny_model_dir, run, use_lora=use_lora, lr=0.05))
    trainer.rollout_and_update(0)
    trainer.rollout_index = 1
    checkpoint = trainer.save_checkpoint()
    cfg = parse(["serve", "--checkpoint", str(run), "--device", "cpu"])  # the run folder: its newest checkpoint
    assert isinstance(cfg, ServeConfig) and cfg.checkpoint == run
    served = _images(build_engine(cfg))  # no --model-path: the run's base
    expected = _images(Engine(load_model(tiny_model_dir, checkpoint), ServeConfig().engine_config()))
    torch.testing.assert_close(served, expected, rtol=0, atol=1e-6)
    base = _images(build_engine(ServeConfig(model_path=tiny_model_dir, device="cpu")))
    assert not torch.allclose(served, base, atol=1e-4)
