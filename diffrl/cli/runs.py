"""Run folders as the unit the commands take: a run's `config.json` read back.

A training run writes `RUN/config.json` (`{"tree": …, "flags": …}`: every setting, by section and by flat
name). `diffrl evaluate`, `diffrl compare`, `diffrl serve` and `diffrl train --resume` take the run folder
(or one of its checkpoints) and read the model, family, size, steps and CFG from there; a flag given on the
command line wins over the run's value. Light on imports: the CLI's `--help` reads this module.
"""

from __future__ import annotations

from pathlib import Path

from diffrl.utils.run_folders import (  # noqa: F401  (re-exported for the commands)
    CONFIG_FILE,
    Run,
    find_run,
    is_run_folder,
    newest_checkpoint,
    read_flags,
)


def held_out_protocol(run: Run) -> dict:
    """How the run sampled its held-out evaluation (what `diffrl evaluate RUN` repeats): ODE steps, CFG scales,
    size, frames and the negative prompt, by the names of evaluate's and compare's flags. Empty without a run."""
    if run.folder is None:
        return {}
    f = run.flags
    own_cfg = f.get("eval_guidance_scale") is None  # the rollouts' CFG (both experts), else the override
    own_size = f.get("eval_resolution") is None and f.get("eval_height") is None  # the rollouts' size, else its own
    return {
        "num_steps": f.get("eval_num_steps") or f.get("diffusion_num_steps"),
        "guidance_scale": f.get("diffusion_guidance_scale") if own_cfg else f.get("eval_guidance_scale"),
        "guidance_scale_2": (f.get("eval_guidance_scale_2") if f.get("eval_guidance_scale_2") is not None
                             else f.get("diffusion_guidance_scale_2") if own_cfg else None),
        "resolution": f.get("resolution") if own_size else f.get("eval_resolution"),
        "height": f.get("height") if own_size else f.get("eval_height"),
        "width": f.get("width") if own_size else f.get("eval_width"),
        "num_frames": f.get("eval_num_frames") or f.get("num_frames"),
        "condition_image_size": f.get("eval_condition_image_size") or f.get("condition_image_size"),
        "negative_prompt": f.get("negative_prompt") or "", "reward_frames": f.get("reward_frames"),
    }


def fill_from_run(cfg, run: Run, names: dict[str, str]):
    """`cfg` (a dataclass) with each field of `names` (field → the run's value under that key of
    `held_out_protocol` or the run's flags) that is still None taken from the run; flags given win."""
    from dataclasses import replace

    if run.folder is None:
        return cfg
    protocol = held_out_protocol(run)
    changes = {}
    for name, key in names.items():
        value = protocol[key] if key in protocol else run.flags.get(key)
        if getattr(cfg, name) is None and value is not None:
            changes[name] = type_like(cfg, name, value)
    return replace(cfg, **changes)


def type_like(cfg, name: str, value):
    """A value read from JSON in the field's type (paths as Path, tuples as tuples)."""
    from dataclasses import fields

    hint = str(next((f.type for f in fields(cfg) if f.name == name), ""))
    if "Path" in hint and isinstance(value, str):
        return Path(value)
    if isinstance(value, list):
        return tuple(value)
    return value


def describe(run: Run) -> str:
    """`RUN (checkpoint rollout-N)` for the command's first line."""
    if run.folder is None:
        return str(run.checkpoint)
    return f"run {run.folder} (checkpoint {run.checkpoint.name if run.checkpoint else 'none'})"
