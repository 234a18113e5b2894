"""Checkpoints of a run: the model a user loads, and what `--resume` needs to continue exactly.

`checkpoints/rollout-N/` holds the model (LoRA in PEFT format under `lora/`, or the full transformer
in diffusers layout under `model/`; the `--use-ema` weights when there are some) and the train state
(`train_state.py`: parameters, optimizer, EMAs, and the loop's counters with the task's position).
`checkpoints/best/` holds the model with the best selection metric of the task, with `best.json`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from safetensors.torch import save_file

from diffrl.train.train_state import load_train_state, save_train_state


class Checkpointer:
    def __init__(self, run_dir: Path, policy):
        self.dir = run_dir / "checkpoints"
        self.policy = policy

    def save(self, rollout_index: int, meta: dict) -> Path:
        """Every rank calls this (a sharded save is collective)."""
        p = self.policy
        path = self.dir / f"rollout-{rollout_index:05d}"
        path.mkdir(parents=True, exist_ok=True)
        self.save_model(path)
        save_train_state(path, transformer=p.transformer, params=p.params, names=p.trainable_names,
                         optimizer=p.optimizer, emas=p.emas(), meta=meta, parallel=p.parallel)
        return path

    def load_latest(self) -> tuple[Path, dict]:
        """Restore the last checkpoint into the policy; returns its path and the saved counters."""
        checkpoints = sorted(self.dir.glob("rollout-*"))
        if not checkpoints:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.dir}")
        p = self.policy
        meta = load_train_state(checkpoints[-1], transformer=p.transformer, params=p.params, names=p.trainable_names,
                                optimizer=p.optimizer, emas=p.emas(), device=p.device, parallel=p.parallel)
        return checkpoints[-1], meta

    def save_best(self, record: dict) -> None:
        path = self.dir / "best"
        path.mkdir(parents=True, exist_ok=True)
        self.save_model(path)
        if self.policy.parallel.is_main:
            (path / "best.json").write_text(json.dumps(record, indent=2) + "\n")

    def save_model(self, path: Path) -> None:
        """The model a user loads, the weights evaluation scores (the --use-ema EMA, else the current
        ones). Under torchrun rank 0 writes it from the engine's copy, which holds the full weights after
        the sync; every rank takes part in the sync."""
        p = self.policy
        if p.parallel.enabled:
            with p.engine_weights(p.eval_ema):
                pass  # the sync leaves the full weights to save (the EMA's, with one) in the engine's copy
            if p.parallel.is_main:
                self._write(p.engine_family, path)
            return
        with p.eval_ema.swapped_in() if p.eval_ema is not None else contextlib.nullcontext():
            self._write(p.family, path)

    def _write(self, family, path: Path) -> None:
        transformer = family.transformer
        if self.policy.use_lora:
            from peft import get_peft_model_state_dict

            lora_dir = path / "lora"
            lora_dir.mkdir(exist_ok=True)
            save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(transformer).items()},
                      str(lora_dir / "adapter_model.safetensors"))
            transformer.peft_config["default"].save_pretrained(str(lora_dir))
        else:
            family.save(path / "model")
