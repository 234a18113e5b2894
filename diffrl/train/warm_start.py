"""`--init-from`: the weights a run starts from when they are not the base model's own.

A checkpoint holding full weights (a full finetune's `model/`, a diffusers model, a `transformer/` folder) is loaded
as the model itself, so a full finetune trains on from it and a LoRA run trains a fresh adapter on top of it. A
checkpoint holding a LoRA adapter loads the base model from `--model-path`; the policy copies the adapter into the
run's own once it has added it (`Policy`), so the run's adapter starts where the saved one ended.
The schedule is this run's (--flow-shift, set on the policy), not the saved run's."""

from __future__ import annotations

from pathlib import Path

import torch

from diffrl.errors import ModelLoadError
from diffrl.models.checkpoint import load_model, lora_folder, open_checkpoint


def warm_start(model_cfg, device: torch.device, dtype: torch.dtype):
    """(the family to train, the folder of a LoRA adapter to copy into the run's adapter or None)."""
    adapter, family = None, model_cfg.diffusion_model_family
    if model_cfg.init_from is not None:
        checkpoint = open_checkpoint(Path(model_cfg.init_from))
        adapter = lora_folder(checkpoint)
        if adapter is None:  # full weights: the model itself
            return load_model(model_cfg.model_path, checkpoint, family=family, device=device, dtype=dtype,
                              flow_shift=None, condition_image_size=None), None
        if not model_cfg.use_lora:
            raise ModelLoadError(f"--init-from {model_cfg.init_from} holds a LoRA adapter ({adapter}): it warm-starts "
                                 "a LoRA run (--use-lora); a full finetune starts from full weights")
    return load_model(model_cfg.model_path, family=family, device=device, dtype=dtype, flow_shift=None,
                      condition_image_size=None), adapter
