"""TensorBoard gets a small grid of rollout samples with their rewards, once per eval interval."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_trainer import tiny_config

from diffrl.train.trainer import Trainer


def test_rollout_samples_go_to_tensorboard_once_per_eval_interval(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    Trainer(tiny_config(tiny_model_dir, out, num_rollout=3, eval_interval=2, eval_images_per_category=0,
                        checkpoint_interval=3)).train()
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    images = events.Images("rollout/samples")
    assert [e.step for e in images] == [1, 3]  # rollouts 0 and 2 (logged as rollouts 1 and 3, with their records)
    assert (images[0].width, images[0].height) == (6 * 64, 64)  # one grid of the 6 samples (2 prompts × 3)
    texts = events.Tensors("rollout/samples/captions/text_summary")
    captions = texts[0].tensor_proto.string_val[0].decode()
    assert captions.count("reward ") == 2 * 3 and " | " in captions  # every sample of the rollout: 2 prompts × 3
