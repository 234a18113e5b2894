"""Load a model with a training checkpoint applied: what `diffrl evaluate` and `diffrl compare` read.

A checkpoint is any of
- a full model directory (diffusers layout with `model_index.json`), or a run checkpoint holding one
  under `model/` (full finetune);
- a run checkpoint with `lora/` (PEFT adapter, or one per pipeline component in `lora/<component>/`: Wan2.2's
  experts), applied on top of the base model;
- a directory with `transformer/` weights but no text encoder (a full finetune copied without the
  untrained text encoder), loaded into the base model's transformer.

A run checkpoint with `manifest.json` is checked against it first (sizes and sha256), and NaN or inf
weights are refused (`diffrl.models.weights`); both errors name the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

from diffrl.algorithms.methods import folds_lora
from diffrl.errors import ModelLoadError, WeightsMismatch
from diffrl.models.base import FamilyAdapter
from diffrl.models.lora import current_lora, keep_autocast_inputs, set_lora_folding
from diffrl.models.registry import resolve_family
from diffrl.models.weights import read_weights
from diffrl.utils.manifest import verify_checkpoint


def load_model(base_path: Path, checkpoint: Path | None = None, *, family: str | None = None,
               device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               flow_shift: float | Literal["run"] | None = "run",
               condition_image_size: int | Literal["run"] | None = "run") -> FamilyAdapter:
    """The base model, or the base model with `checkpoint` applied (see the module docstring); `dtype`: the
    family's load dtype (None: its default). `flow_shift`: a static schedule shift (`set_flow_shift`);
    `condition_image_size`: the side of the largest condition image area (`set_condition_image_area`); for each, "run":
    the one the checkpoint's run trained with (its --flow-shift, --condition-image-size) if any; None: the model's own.
    A LoRA checkpoint samples as its run sampled: its adapter folded into the weights where the run's method folds
    it (--fold-lora-without-grad), unfolded otherwise and without a run."""
    model = _load_model(base_path, checkpoint, family=family, device=device, dtype=dtype)
    run = {} if checkpoint is None else _run_flags(checkpoint)
    if current_lora(model.transformer) is not None:  # sampled as its run sampled: folded where the method folds
        folds = folds_lora(run.get("loss_type", ""), run.get("fold_lora_without_grad", "auto"))
        set_lora_folding(model.transformer, folds)
    if flow_shift == "run":
        flow_shift = run.get("flow_shift")
    if flow_shift is not None:
        model.set_flow_shift(float(flow_shift))
    if condition_image_size == "run":
        condition_image_size = run.get("condition_image_size")
    if condition_image_size is not None:
        model.set_condition_image_area(int(condition_image_size) ** 2)
    return model


def _load_model(base_path: Path, checkpoint: Path | None, *, family: str | None, device: torch.device | str,
                dtype: torch.dtype | None) -> FamilyAdapter:
    family_cls = resolve_family(family, base_path)  # a checkpoint is of its base model's family
    dtype_kw = {} if dtype is None else {"dtype": dtype}
    if checkpoint is None:
        return family_cls.load(base_path, device=device, **dtype_kw)
    checkpoint = open_checkpoint(checkpoint)
    for full in (checkpoint, checkpoint / "model"):
        if _is_full_model(full):
            return family_cls.load(full, device=device, **dtype_kw)
    model = family_cls.load(base_path, device=device, **dtype_kw)
    lora_dir = lora_folder(checkpoint)
    if lora_dir is not None:
        try:
            _apply_lora(model, lora_dir)
        except WeightsMismatch as err:
            raise _another_base(f"{lora_dir}: its LoRA ({err}) does not fit", model, base_path, checkpoint) from None
        except ValueError as err:  # PEFT: "Target modules … not found in the base model" names no model
            if "not found in the base model" not in str(err):
                raise
            raise _another_base(f"{lora_dir}: its LoRA targets are not modules of", model, base_path, checkpoint) from None
        return model
    for model_dir in (checkpoint, checkpoint / "model"):
        if _has_transformer(model_dir):
            try:
                model.load_saved_transformer(model_dir)  # the family's own layout (e.g. Wan2.2's two experts)
            except WeightsMismatch:
                raise _another_base(f"{model_dir / 'transformer'} was not trained from", model, base_path,
                                    checkpoint) from None
            return model
    raise AssertionError("check_checkpoint admitted a directory holding no model")  # unreachable


def check_fits(model: FamilyAdapter, base_path: Path, checkpoint: Path) -> None:
    """Without reading any weights, the ModelLoadError `load_model(base_path, checkpoint)` would raise because the
    checkpoint was trained from another base: its run's family is not `model`'s, or a LoRA's tensors name modules
    `model` lacks or have other sizes. `diffrl compare` samples the base model before it loads the trained one: a
    mismatch found only then cost the whole base evaluation."""
    from safetensors import safe_open

    checkpoint = Path(checkpoint)
    if any(_is_full_model(d) for d in (checkpoint, checkpoint / "model")):
        return  # a whole model: no base involved
    family = _run_flags(checkpoint).get("diffusion_model_family")
    if isinstance(family, str) and family != model.name:
        raise _another_base(f"{checkpoint} (from a run of the {family} family) does not fit", model, base_path, checkpoint)
    lora_dir = checkpoint / "lora" if (checkpoint / "lora").is_dir() else checkpoint
    if not _has_lora(lora_dir):
        return
    modules = dict(model.transformer.named_modules())
    for folder, prefix in _lora_files(model, lora_dir):
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            adapted = {prefix + k.removeprefix("base_model.model.").partition(".lora_")[0] for k in f.keys()}
            targets = json.loads((folder / "adapter_config.json").read_text()).get("target_modules")
            if isinstance(targets, list):  # a base with more layers: modules it targets that the file leaves out
                left = next((n for n, m in modules.items() if n.startswith(prefix) and isinstance(m, torch.nn.Linear)
                             and any(n == t or n.endswith("." + t) for t in targets) and n not in adapted), None)
                if left is not None:
                    raise _another_base(f"{lora_dir}: its LoRA (no weights for {left}) does not fit", model,
                                        base_path, checkpoint)
            for key in f.keys():
                name, _, rest = key.removeprefix("base_model.model.").partition(".lora_")
                target, shape = modules.get(prefix + name), f.get_slice(key).get_shape()
                want = (getattr(target, "in_features", None) if rest.startswith("A") else
                        getattr(target, "out_features", None) if rest.startswith("B") else None)
                if target is None or (want is not None and len(shape) == 2 and shape[rest.startswith("A")] != want):
                    problem = "a module it lacks" if target is None else f"other sizes ({key}: {list(shape)})"
                    raise _another_base(f"{lora_dir}: its LoRA ({problem}: {prefix}{name}) does not fit", model,
                                        base_path, checkpoint)


def _run_flags(checkpoint: Path) -> dict:
    """The flat settings of the run a checkpoint belongs to (its config.json), or {} when it is not beside one."""
    for run_dir in Path(checkpoint).resolve().parents[:3]:  # RUN/checkpoints/rollout-N[/lora]
        try:
            flags = json.loads((run_dir / "config.json").read_text())["flags"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(flags, dict):
            return flags
    return {}


def _another_base(problem: str, model: FamilyAdapter, base_path: Path, checkpoint: Path) -> ModelLoadError:
    """A checkpoint applied to a base it was not trained from: usually the base was left at its default (the demo
    model) for another family's run. Names the base, the run's own (its config.json, when beside it) and the flag."""
    trained = _run_flags(checkpoint).get("model_path")
    run = f" (its run trained {trained})" if trained else ""
    return ModelLoadError(f"{problem} the {model.name} model at {base_path}{run}; pass the base model the run "
                          "trained (--model-path, or --base for diffrl compare)")


def open_checkpoint(checkpoint: Path) -> Path:
    """`checkpoint`, verified against its manifest when it is a run checkpoint and checked to hold a model (no weights
    read), else a ModelLoadError naming it."""
    checkpoint = Path(checkpoint)
    if (checkpoint / "manifest.json").is_file():  # a run checkpoint: its files must match what was written
        problem = verify_checkpoint(checkpoint)
        if problem is not None:
            raise ModelLoadError(f"damaged checkpoint: {checkpoint} ({problem})")
    return check_checkpoint(checkpoint)


def lora_folder(checkpoint: Path) -> Path | None:
    """The folder holding a checkpoint's PEFT adapter(s) (`lora/`, or the checkpoint itself), or None when it holds
    full weights."""
    lora_dir = checkpoint / "lora" if (checkpoint / "lora").is_dir() else checkpoint
    return lora_dir if _has_lora(lora_dir) else None


def load_lora_weights(model: FamilyAdapter, lora_dir: Path, rank: int, alpha: float, targets: list[str]) -> None:
    """Copy the adapter saved in `lora_dir` into the adapter "default" of `model.transformer` (made by
    `models.lora.add_lora` with this rank, alpha and targets): a LoRA run's warm start. An adapter of another rank,
    alpha or target set is refused naming the flags that would match it; tensors are checked as `_apply_lora` does."""
    from peft import set_peft_model_state_dict

    files = _lora_files(model, lora_dir)
    for folder, _ in files:
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
            theirs = (int(config["r"]), float(config["lora_alpha"]), config["target_modules"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{folder / 'adapter_config.json'}: not a PEFT LoRA config ({err})") from None
        their_targets = sorted(set(theirs[2])) if isinstance(theirs[2], list) else theirs[2]
        if (theirs[0], theirs[1], their_targets) != (rank, float(alpha), sorted(set(targets))):
            shown = ", ".join(their_targets) if isinstance(their_targets, list) else repr(their_targets)
            raise ModelLoadError(
                f"{folder}: its adapter (rank {theirs[0]}, alpha {theirs[1]:g}, targets {shown}) is not this run's "
                f"(rank {rank}, alpha {float(alpha):g}, targets {', '.join(sorted(set(targets)))}); pass --lora-rank "
                f"{theirs[0]} --lora-alpha {theirs[1]:g} --lora-target-modules {shown.replace(', ', ' ')}")
    try:
        result = set_peft_model_state_dict(model.transformer, _adapter_state(files), adapter_name="default")
    except RuntimeError as err:
        lines = str(err).strip().splitlines()
        raise ModelLoadError(f"{lora_dir}: its adapter does not fit the {model.name} model "
                             f"({(lines[1] if len(lines) > 1 else lines[0]).strip()})") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        problem = (f"keys of no module here, e.g. {result.unexpected_keys[0]}" if result.unexpected_keys
                   else f"{len(missing)} adapter tensors of this model missing, e.g. {missing[0]}")
        raise ModelLoadError(f"{lora_dir}: its adapter does not fit the {model.name} model ({problem})")


def check_checkpoint(checkpoint: Path) -> Path:
    """`checkpoint` if it is a directory holding a model in one of the layouts above, else a ModelLoadError
    naming it. Cheap (no weights read): a command that loads the checkpoint late (`diffrl compare` loads it
    after the base model's images) calls it first, so a wrong path fails before any sampling."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise ModelLoadError(f"checkpoint directory not found: {checkpoint}")
    candidates = (checkpoint, checkpoint / "model")
    if (any(_is_full_model(d) or _has_transformer(d) for d in candidates)
            or _has_lora(checkpoint / "lora") or _has_lora(checkpoint)):
        return checkpoint
    hint = " (a run folder: pass one of its checkpoints/rollout-N)" if (checkpoint / "checkpoints").is_dir() else ""
    raise ModelLoadError(f"{checkpoint} holds no model{hint}: expected model_index.json, model/, "
                         "lora/adapter_config.json or transformer/diffusion_pytorch_model.safetensors")


def _is_full_model(directory: Path) -> bool:
    return (directory / "model_index.json").is_file() and (directory / "text_encoder").is_dir()


def _has_transformer(directory: Path) -> bool:
    return (directory / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


def _has_lora(directory: Path) -> bool:
    """Whether `directory` holds a PEFT adapter, or one per pipeline component (`FamilyAdapter.lora_components`)."""
    return (directory / "adapter_config.json").is_file() or any(directory.glob("*/adapter_config.json"))


def _lora_files(model: FamilyAdapter, lora_dir: Path) -> list[tuple[Path, str]]:
    """(adapter folder, the prefix its keys take in `model.transformer`) of each adapter in `lora_dir`."""
    if (lora_dir / "adapter_config.json").is_file():  # one adapter for the whole transformer
        return [(lora_dir, "")]
    folders = [(lora_dir / name, f"{name}.") for name in model.lora_components
               if (lora_dir / name / "adapter_config.json").is_file()]
    if not folders:
        per_part = f", nor one in {' or '.join(f'{c}/' for c in model.lora_components)}" if model.lora_components else ""
        raise ModelLoadError(f"{lora_dir} holds no adapter_config.json for the {model.name} model{per_part}")
    return folders


def _adapter_state(files: list[tuple[Path, str]]) -> dict[str, torch.Tensor]:
    """The adapters' tensors under PEFT's names in the whole transformer (each folder's keys under its prefix);
    `read_weights` names a file that is missing or corrupt."""
    state = {}
    for folder, prefix in files:
        state.update({f"base_model.model.{prefix}{k.removeprefix('base_model.model.')}": v
                      for k, v in read_weights(folder / "adapter_model.safetensors").items()})
    return state


def _apply_lora(model: FamilyAdapter, lora_dir: Path) -> None:
    from peft import LoraConfig, set_peft_model_state_dict

    transformer = model.transformer
    files = _lora_files(model, lora_dir)
    state = _adapter_state(files)
    weights = files[0][0] / "adapter_model.safetensors"
    transformer.add_adapter(LoraConfig.from_pretrained(str(files[0][0])))
    keep_autocast_inputs(transformer)  # the layers the trainer's adapter has (`models.lora.add_lora`)
    try:
        result = set_peft_model_state_dict(transformer, state)
    except RuntimeError as err:  # torch's "Error(s) in loading state_dict …", a line per tensor of other sizes
        lines = str(err).strip().splitlines()
        raise WeightsMismatch(lines[1].strip() if len(lines) > 1 else lines[0]) from None
    # A module of the base without weights in the file keeps its fresh adapter (B = 0): a base with more layers.
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys:
        raise WeightsMismatch(f"unexpected keys {result.unexpected_keys[:3]}")
    if missing:
        raise WeightsMismatch(f"{len(missing)} adapter tensors of this base are not in {weights.name}, e.g. {missing[0]}")
