"""The engine spec of a training run: what every engine it samples with is built from (`diffrl.engine.spec`).

The in-process engine, a `--colocate` engine process and `--ray-engines` actors all take this spec, so they load
the trainer's checkpoint in the trainer's dtypes (a full finetune's fp32 masters included), with its forward
precision, speed options, compilation and batching, and sample what the trainer would replay.
"""

from __future__ import annotations

import dataclasses

import torch

from diffrl.engine.spec import EngineSpec
from diffrl.train.config import TrainConfig
from diffrl.train.policy import bf16_forward
from diffrl.utils import determinism


def engine_spec(cfg: TrainConfig, device: torch.device, family: str | None = None) -> EngineSpec:
    """The engine of a run on `device`; `family`: the loaded model's family name (None: the flag's)."""
    m = cfg.model
    bf16 = bf16_forward(m, device)
    return EngineSpec(
        model_path=str(m.model_path), family=family or m.diffusion_model_family, device=str(device),
        dtype="bfloat16" if bf16 else "float32", transformer_dtype=None if m.use_lora else "float32",
        autocast_dtype="bfloat16" if bf16 else None, detach_uncond=cfg.algorithm.detach_uncond,
        flow_shift=m.flow_shift, condition_image_size=m.condition_image_size, offload_text_encoder=m.offload_text_encoder,
        **dataclasses.asdict(m.speed_options()),
        max_outputs_per_request=max(64, cfg.rollout.rollout_microgroup_size),
        max_batch_outputs=determinism.engine_batch_outputs(cfg.engine.engine_max_batch_outputs, cfg.deterministic_mode),
        float32_matmul_precision=m.float32_matmul_precision, deterministic=cfg.deterministic_mode)
