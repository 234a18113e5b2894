"""Checkpoints of a run: the model a user loads, and what `--resume` needs to continue exactly.

`checkpoints/rollout-N/` holds the model (LoRA in PEFT format under `lora/`, or the full transformer
in diffusers layout under `model/`; the `--use-ema` weights when there are some), the train state
(`train_state.py`: parameters, optimizer, EMAs, and the loop's counters with the task's position) and
`manifest.json`, the size and sha256 of every other file in the folder.
`checkpoints/best/` holds the model with the best selection metric of the task, with `best.json`.

Writes are atomic: a checkpoint is written into `.rollout-N.partial/` beside its final name, every
file is fsynced and listed in the manifest, and only then is the folder renamed into place (an
existing one is swapped out atomically). A crash or kill at any moment leaves either the previous
checkpoint or the new complete one. `--resume` takes the newest folder whose manifest is present and
whose every file matches it; damaged or incomplete ones are skipped with one printed line.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from diffrl.train.train_state import (
    META_FILE,
    SHARDED_DIR,
    SINGLE_FILE,
    load_train_state,
    read_single_file,
    save_train_state,
)
from diffrl.utils.manifest import MANIFEST, publish, verify_checkpoint, write_manifest

PARTIAL_SUFFIX = ".partial"
_ROLLOUT = re.compile(r"rollout-(\d+)")


class Checkpointer:
    def __init__(self, run_dir: Path, policy, keep_last: int | None = None):
        """`keep_last`: after each save, only the newest this many `rollout-N` folders stay (None: every one);
        `best/` is never removed."""
        self.dir = run_dir / "checkpoints"
        self.policy = policy
        self.keep_last = keep_last

    def save(self, rollout_index: int, meta: dict) -> Path:
        """Every rank calls this (a sharded save is collective)."""
        p = self.policy
        path = self.dir / f"rollout-{rollout_index:05d}"
        with self._staged(path) as staging:
            self.save_model(staging)
            save_train_state(staging, transformer=p.transformer, params=p.params, names=p.trainable_names,
                             optimizer=p.optimizer, emas=p.emas(), meta=meta, parallel=p.parallel)
        if self.keep_last is not None and p.parallel.is_main:
            self._prune(self.keep_last)
        return path

    def _prune(self, keep: int) -> None:
        """Remove all but the newest `keep` rollout checkpoints, oldest first (the one just published is newest)."""
        found = sorted((int(m.group(1)), c) for c in self.dir.glob("rollout-*")
                       if c.is_dir() and (m := _ROLLOUT.fullmatch(c.name)))
        for _, old in found[:-keep]:
            shutil.rmtree(old)

    def load_latest(self) -> tuple[Path, dict]:
        """Restore the newest complete checkpoint into the policy; returns its path and the saved counters.
        Under torchrun rank 0 verifies the folders and tells the other ranks which one to load."""
        p = self.policy
        choice = self._choose() if p.parallel.is_main else None
        if p.parallel.enabled:
            import torch.distributed as dist

            box = [choice]
            dist.broadcast_object_list(box, src=0)
            choice = box[0]
        kind, value = choice
        if kind != "ok":
            raise (FileNotFoundError if kind == "missing" else ValueError)(value)
        path = Path(value)
        meta = load_train_state(path, transformer=p.transformer, params=p.params, names=p.trainable_names,
                                optimizer=p.optimizer, emas=p.emas(), device=p.device, parallel=p.parallel)
        return path, meta

    def _choose(self) -> tuple[str, str]:
        """("ok", path) of the newest usable checkpoint, else ("missing" | "damaged", a one-line message).
        Folders without a manifest are from a diffrl that wrote none when no folder has one: those are
        loaded unverified (the newest whose train state reads)."""
        found = sorted(((int(m.group(1)), c) for c in self.dir.glob("rollout-*")
                        if c.is_dir() and (m := _ROLLOUT.fullmatch(c.name))), reverse=True)
        for stale in self.dir.glob(f".*{PARTIAL_SUFFIX}"):  # writes a crash or kill cut short
            shutil.rmtree(stale, ignore_errors=True)
        if not found:
            return "missing", (f"--resume: no checkpoint under {self.dir} to resume (a run stopped before its first "
                               f"checkpoint starts again without --resume, in an empty or new --output-dir)")
        legacy = not any((c / MANIFEST).is_file() for _, c in found)
        if legacy:
            print(f"--resume: the checkpoints under {self.dir} have no {MANIFEST} (an older diffrl wrote them); "
                  "they load unverified")
        skipped = []
        for _, candidate in found:
            problem = unreadable_train_state(candidate) if legacy else verify_checkpoint(candidate)
            if problem is None:
                return "ok", str(candidate)
            print(f"--resume: skipping {candidate}: {problem}")
            skipped.append(f"{candidate.name}: {problem}")
        return "damaged", f"--resume: no complete checkpoint under {self.dir} ({'; '.join(skipped)})"

    def save_best(self, record: dict) -> None:
        with self._staged(self.dir / "best") as staging:
            self.save_model(staging)
            if self.policy.parallel.is_main:
                (staging / "best.json").write_text(json.dumps(record, indent=2) + "\n")

    @contextlib.contextmanager
    def _staged(self, final: Path):
        """Yield an empty staging folder beside `final`; after the block, with every rank done writing,
        rank 0 fsyncs and lists the files in the manifest and renames the folder to `final`. A failure
        inside the block leaves `final` untouched (the staging folder is cleared by the next save)."""
        par = self.policy.parallel
        staging = final.with_name(f".{final.name}{PARTIAL_SUFFIX}")
        if par.is_main:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        _barrier(par)
        yield staging
        _barrier(par)  # every rank's shards are written before rank 0 lists them
        if par.is_main:
            write_manifest(staging)
            publish(staging, final)
        _barrier(par)  # the checkpoint is in place for every rank when save returns

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

            state = get_peft_model_state_dict(transformer)
            # One adapter for the transformer in lora/, or one per pipeline component it wraps in lora/<component>/
            # (Wan2.2's experts, `lora_components`): what PeftModel.from_pretrained(pipe.<component>, …) loads.
            parts = {"": state} if not family.lora_components else {
                name: {k.removeprefix(f"{name}."): v for k, v in state.items() if k.startswith(f"{name}.")}
                for name in family.lora_components}
            for folder, part in parts.items():
                if not part:  # a component this checkpoint does not have (a one-expert Wan)
                    continue
                lora_dir = path / "lora" / folder
                lora_dir.mkdir(parents=True, exist_ok=True)
                # Under PEFT's prefix, as PeftModel.save_pretrained writes it: PeftModel.from_pretrained loads it
                # (unprefixed, it warned of missing keys and kept a fresh adapter, B = 0: the base model).
                save_file({f"base_model.model.{k}": v.contiguous() for k, v in part.items()},
                          str(lora_dir / "adapter_model.safetensors"))
                transformer.peft_config["default"].save_pretrained(str(lora_dir))
                _save_diffusers_lora(lora_dir, part, transformer.peft_config["default"])
        else:
            family.save(path / "model")


# diffusers' LoRA file: what `pipe.load_lora_weights(DIR)` picks in a folder (it finds no key of PEFT's layout under its
# `transformer.` prefix, warns and keeps the base model), with the adapter's config as diffusers' own
# `save_lora_weights` stores it, so α/r is the trained scale.
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"


def _save_diffusers_lora(lora_dir: Path, state: dict, config) -> None:
    settings = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    metadata = {"format": "pt", "lora_adapter_metadata": json.dumps(
        {f"transformer.{k}": v for k, v in settings.items()}, indent=2, sort_keys=True, default=str)}
    save_file({f"transformer.{k}": v.contiguous() for k, v in state.items()}, str(lora_dir / DIFFUSERS_LORA_FILE),
              metadata=metadata)


def _barrier(parallel) -> None:
    if parallel.enabled:
        import torch.distributed as dist

        dist.barrier()


def unreadable_train_state(folder: Path) -> str | None:
    """For checkpoints without a manifest: None when the train state is there and its file loads."""
    if (folder / SHARDED_DIR).is_dir():
        return None if (folder / META_FILE).is_file() else f"{META_FILE} is missing"
    try:
        read_single_file(folder / SINGLE_FILE, "cpu")
    except (ValueError, FileNotFoundError) as err:
        return str(err)
    return None
