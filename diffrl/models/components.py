"""Reading a diffusers-format checkpoint directory from a family's table of components.

Each `Component` names a folder of the checkpoint and the class that loads it. `load_components` checks
every folder's config file first (a missing or corrupt one is named in a one-line `ModelLoadError`), loads
them, moves the modules to the device in eval mode without gradients and refuses NaN or inf weights.
`read_settings` reads a family's per-checkpoint settings from the `diffrl` block of `model_index.json`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffrl.errors import AnotherFamilysCheckpoint, ModelLoadError
from diffrl.models.families import family_names, get_family
from diffrl.models.weights import require_finite_modules
from diffrl.utils.device import built_in

# The file every folder of a kind holds, read before loading so that a missing or corrupt one is named.
CONFIG_FILES = {"model": "config.json", "tokenizer": "tokenizer_config.json", "scheduler": "scheduler_config.json"}
# A diffusers model folder holding this file and its config.json but no weight files gets random weights drawn at
# load, from the file's seed, on the load's device in its dtype: the benchmarks' real-size random transformers
# without tens of GB on disk (`random_checkpoints.make_weightless`; FLUX.2 [dev]'s 32 B would not fit a 64 GB disk).
RANDOM_INIT_FILE = "diffrl_random_init.json"


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file (config, scheduler, model index), or a `ModelLoadError` naming the file."""
    if not path.is_file():
        raise ModelLoadError(f"missing file: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"corrupt file: {path} ({err.__class__.__name__}: {err})") from None


@dataclass(frozen=True)
class Component:
    """One folder of a checkpoint. `loader` is `"package:Class"` (loaded with the class's `from_pretrained`,
    locally, in the load's dtype for models) or a function `(folder, dtype) -> component` for a custom layout."""

    folder: str
    loader: str | Callable[[Path, torch.dtype], Any]
    kind: str = "model"  # "model", "tokenizer" or "scheduler"
    text_encoder: bool = False  # left out (None) when the family is loaded without its text encoders
    optional: bool = False  # None when the checkpoint lacks it (its config file is absent)
    config_file: str | None = None  # read before loading; None: the kind's usual file
    class_name: str | None = None  # the class a custom `loader` builds (a "package:Class" loader names its own)

    @property
    def config_path(self) -> str:
        return f"{self.folder}/{self.config_file or CONFIG_FILES[self.kind]}"

    @property
    def loads_class(self) -> str | None:
        """The diffusers/transformers class this folder holds, as a checkpoint's `_class_name` spells it."""
        return self.loader.partition(":")[2] if isinstance(self.loader, str) else self.class_name

    def load(self, root: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
        folder = root / self.folder
        if callable(self.loader):
            return self.loader(folder, dtype)
        package, name = self.loader.split(":")
        cls = getattr(importlib.import_module(package), name)
        if self.kind != "model":
            return cls.from_pretrained(str(folder), local_files_only=True)
        if package == "diffusers" and (folder / RANDOM_INIT_FILE).is_file():
            return drawn_at_load(cls, folder, dtype, device)
        if package == "diffusers":
            return cls.from_pretrained(folder, torch_dtype=dtype, local_files_only=True)
        return cls.from_pretrained(str(folder), dtype=dtype, local_files_only=True)


def weight_files(folder: Path) -> list[Path]:
    """A diffusers model folder's weight files (safetensors or .bin shards and their index), sorted by name."""
    return sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json"))


def drawn_at_load(cls, folder: Path, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """The diffusers model `cls` of `folder`'s config.json with its default random initialization, drawn from the seed
    of `folder`'s RANDOM_INIT_FILE (the same weights on one device and torch version), built on `device` in `dtype`.
    A folder that also holds weight files is refused: which weights were meant would be a guess."""
    marker = folder / RANDOM_INIT_FILE
    if weights := weight_files(folder):
        raise ModelLoadError(f"{folder} holds {RANDOM_INIT_FILE} (random weights drawn at load) and weight files "
                             f"({weights[0].name}): remove one of them")
    seed = read_json(marker).get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ModelLoadError(f"corrupt file: {marker} (its seed must be an integer from 0, got {seed!r})")
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the caller's RNG as it was
        torch.manual_seed(seed)
        with built_in(device, dtype), torch.no_grad():
            return cls.from_config(cls.load_config(folder))


def checkpoint_root(model_path: str | Path) -> Path:
    root = Path(model_path)
    if not root.is_dir():
        raise ModelLoadError(f"model directory not found: {root}{hub_id_hint(model_path)}")
    return root


def hub_id_hint(path: str | Path) -> str:
    """For a missing path that reads as a hub id (org/name, its folder absent too): a note that diffrl reads local
    directories only, and how to download one; else ''."""
    text, local = str(path), Path(path)
    if local.exists() or text.count("/") != 1 or text.startswith((".", "/", "~")) or local.parent.exists():
        return ""
    return (" (a hub id? diffrl reads local directories only: download it first, e.g. `huggingface-cli download "
            f"{text} --local-dir DIR`, and pass DIR)")


def read_model_index(root: Path, *, required: bool) -> dict:
    """`model_index.json`, or {} when the checkpoint has none and the family does not need one."""
    index_file = root / "model_index.json"
    return read_json(index_file) if required or index_file.is_file() else {}


def read_settings(settings_class: type, index: dict, index_file: Path, **values):
    """`settings_class(**values)` overridden by the `diffrl` block of the model index (its `family` key aside)."""
    overrides = dict(index.get("diffrl", {}))
    overrides.pop("family", None)
    try:
        return settings_class(**{**values, **overrides})
    except TypeError as err:
        raise ModelLoadError(f"corrupt file: {index_file} (bad 'diffrl' block: {err})") from None


def load_components(root: Path, table: Iterable[Component], *, label: str, device: torch.device | str,
                    dtype: torch.dtype, load_text_encoder: bool) -> dict[str, Any]:
    """Every component of `table` by folder name (None for one left out or absent)."""
    parts: dict[str, Any] = {}
    wanted = []
    for component in table:
        absent = component.optional and not (root / component.config_path).is_file()
        parts[component.folder] = None
        if not absent and (load_text_encoder or not component.text_encoder):
            wanted.append(component)
    for component in wanted:  # another family's checkpoint is named before any file it lacks is
        _refuse_another_familys(root, component, label)  # (FamilyAdapter.load checks before that, for every family)
    for component in wanted:
        read_json(root / component.config_path)
    try:
        parts.update({component.folder: component.load(root, dtype, device) for component in wanted})
    except (OSError, ValueError) as err:
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        raise ModelLoadError(f"cannot load the {label} checkpoint {root}: {first_line}") from None
    modules = {folder: part for folder, part in parts.items() if isinstance(part, torch.nn.Module)}
    for module in modules.values():
        module.to(device=device).eval().requires_grad_(False)
    require_finite_modules(root, modules)
    return parts


def refuse_another_familys(root: Path, family: str, label: str, table: Iterable[Component]) -> None:
    """A ModelLoadError when the checkpoint at `root` is another family's (an SD3 recipe on a Qwen-Image checkpoint):
    its model index names another family (`diffrl.family`, what diffrl writes), or a folder of `table` holds a
    model of another class that another family loads there. Run before the family reads anything else of the
    checkpoint, whose settings and scheduler another family's checkpoint would fail on with a misleading message."""
    for component in table:
        _refuse_another_familys(root, component, label)
    claimed = _index_family(root)
    if claimed is not None and claimed != family:
        _another_familys(root, [claimed], "its model_index.json names it", label, None)


def _index_family(root: Path) -> str | None:
    """The family a diffrl-written `model_index.json` names (`diffrl.family`), when it is a known family."""
    try:
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    block = index.get("diffrl") if isinstance(index, dict) else None
    name = block.get("family") if isinstance(block, dict) else None
    return name if isinstance(name, str) and name in family_names() else None


def _another_familys(root: Path, owners: list[str], evidence: str, label: str, loads: str | None) -> None:
    """The one-line refusal, in the order a reader acts on it: what the checkpoint is (and how we know), what the
    run's family is, what to pass instead (the command line adds the recipes of that family)."""
    names = " or ".join(owners)
    raise AnotherFamilysCheckpoint(f"{root} is a checkpoint of the {names} family ({evidence}), not of {label}"
                                   + (f" ({loads})" if loads else ""), owners)


def _refuse_another_familys(root: Path, component: Component, label: str) -> None:
    """A ModelLoadError when `component`'s folder holds a diffusers model of another class that another family
    loads there. A class no family loads is left for `from_pretrained` to judge."""
    expected = component.loads_class
    if expected is None or component.kind != "model" or not (root / component.config_path).is_file():
        return
    found = read_json(root / component.config_path).get("_class_name")
    if not found or found == expected:
        return
    if owners := checkpoint_families(root, component.folder, found):
        _another_familys(root, owners, f"{component.folder}/ holds {found}", label, f"which loads {expected}")


def checkpoint_families(root: Path, folder: str, class_name: str) -> list[str]:
    """The families that load `class_name` in `folder` (`families_loading`), narrowed to those that fit the rest of
    the checkpoint at `root` best: every folder they need present, the most of their model classes matching (a
    FLUX 3 checkpoint's Qwen3-VL text encoder and VAE are FLUX 3's, not the demo model's, which shares its
    transformer class)."""
    owners = families_loading(folder, class_name)
    if (claimed := _index_family(root)) in owners:
        return [claimed]
    fits = {}
    for name in owners:
        components = get_family(name).components
        if any(not c.optional and not (root / c.config_path).is_file() for c in components):
            continue
        fits[name] = sum(c.kind == "model" and c.loads_class is not None and (root / c.config_path).is_file()
                         and checkpoint_class(root, c.folder) == c.loads_class for c in components)
    if not fits:
        return owners
    best = max(fits.values())
    return [name for name in owners if fits.get(name) == best]


def families_loading(folder: str, class_name: str) -> list[str]:
    """The families whose checkpoints hold a model of `class_name` in `folder`, by name (several when
    families share a class: the demo model is a small FLUX 3 transformer)."""
    return [name for name in family_names() if any(
        c.folder == folder and c.kind == "model" and c.loads_class == class_name for c in get_family(name).components)]


def checkpoint_class(root: Path, folder: str) -> str | None:
    """The class of a checkpoint's `folder`: its config's `_class_name`, else the `[library, class]` entry
    `model_index.json` has for it; None when neither says (or is readable)."""
    def read(file: Path) -> dict:
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    name = read(root / folder / CONFIG_FILES["model"]).get("_class_name")
    if not (isinstance(name, str) and name):
        entry = read(root / "model_index.json").get(folder)
        name = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    return name if isinstance(name, str) and name else None


def read_flow_scheduler(family: str, root: Path, supported: Iterable[str], pipeline: str) -> tuple[str, dict]:
    """The checkpoint's scheduler class name and config, refusing one the family's flow-matching steps
    cannot follow: an unsupported class, UniPC without flow σ's, or dynamic shifting `pipeline` never sets up."""
    config = read_json(root / "scheduler" / "scheduler_config.json")
    name = config.get("_class_name")
    if name not in supported:
        raise ModelLoadError(f"{family}: scheduler {name!r} in {root / 'scheduler'}; supported: {', '.join(supported)}")
    if name == "UniPCMultistepScheduler" and not config.get("use_flow_sigmas"):
        raise ModelLoadError(f"{family}: a UniPC scheduler without use_flow_sigmas has no flow-matching schedule")
    if config.get("use_dynamic_shifting"):
        raise ModelLoadError(f"{family}: the scheduler uses dynamic shifting, which {pipeline} does not set up")
    return name, config


def check_max_sequence_length(family: str, length: int, *, limit: int | None = None,
                              pipeline: str | None = None) -> None:
    """A ModelLoadError unless a checkpoint's text window `length` (its `max_sequence_length` setting) is one its
    pipeline takes: in 1..`limit` (FLUX.1, FLUX.2, Chroma, Lumina 2: `pipeline`'s limit, when it names one), or any
    positive count without a limit (CogView4, SANA)."""
    if limit is None:
        if length < 1:
            raise ModelLoadError(f"{family}: max_sequence_length must be positive, got {length}")
    elif not 1 <= length <= limit:
        whose = f" ({pipeline}'s limit)" if pipeline else ""
        raise ModelLoadError(f"{family}: max_sequence_length must be in 1..{limit}{whose}, got {length}")


def refuse_scheduler_options(family: str, scheduler, options: Iterable[str]) -> None:
    """A ModelLoadError naming those of `options` that the scheduler's config turns on: each changes the step that
    the family's sampling reproduces."""
    unsupported = [key for key in options if scheduler.config.get(key)]
    if unsupported:
        raise ModelLoadError(f"{family}: unsupported scheduler options {unsupported} (they change the step that the "
                             "sampling module reproduces)")


def flow_shifted_scheduler(family: str, scheduler, shift: float):
    """A copy of a flow-matching `scheduler` whose σ's are shifted statically by `shift`
    (σ' = shift·σ / (1 + (shift − 1)·σ)) in place of its own static or resolution-dependent shift: what diffusers'
    pipelines get from a scheduler built with `shift=` (FlowMatchEuler) or `flow_shift=` (UniPC, DPM-Solver), e.g.
    Wan's 3.0 at 480p and 5.0 at 720p. A ModelLoadError when the scheduler has no such setting."""
    if not shift > 0:
        raise ModelLoadError(f"{family}: a flow shift must be > 0, got {shift}")
    config = dict(scheduler.config)
    if "shift" in config:
        overrides = {"shift": shift}
    elif "flow_shift" in config and config.get("use_flow_sigmas"):
        overrides = {"flow_shift": shift}
    else:
        raise ModelLoadError(f"{family}: its {type(scheduler).__name__} takes no flow shift (diffusers' `shift` or "
                             "`flow_shift` with use_flow_sigmas)")
    if config.get("use_dynamic_shifting"):
        overrides["use_dynamic_shifting"] = False  # one shift at every resolution, as the override asks
    return type(scheduler).from_config(scheduler.config, **overrides)  # keywords: the config's defaults yield to them


def scheduler_sigmas(family: str, scheduler, num_steps: int, device: torch.device | str) -> torch.Tensor:
    """A scheduler's σ's after `set_timesteps`, fp32 on `device`, checked to be N steps ending at σ = 0 (the
    shared steps integrate to the terminal σ; a scheduler with another final σ would stop short)."""
    sigmas = scheduler.sigmas.to(device=device, dtype=torch.float32)
    if len(sigmas) != num_steps + 1 or float(sigmas[-1]) != 0.0:
        raise ValueError(f"{family}: the scheduler's schedule {sigmas.tolist()} does not end at σ = 0 after "
                         f"{num_steps} steps (final_sigmas_type must be 'zero')")
    return sigmas
