"""`diffrl evaluate`: held-out evaluation of a model, plus a grid.

Three kinds: the editing world's held-out edits (`--world shapes-edit`, an editing run's or an editing model's
world: strict accuracy per edit kind, `evaluate_edit_world`), the shapes world's strict accuracy (the default; with `--save-images`, every image and its
verdict on disk, see `diffrl.evaluation.shapes.save_samples`), or, with `--prompt-data PATH --reward SPEC`,
the mean reward (and each reward component's mean) on the first `--num-prompts` prompts of a prompt
set (a directory's `test` split), every image written to disk (see `diffrl.evaluation.reward_eval`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from diffrl.cli.configs import EvaluateConfig
from diffrl.cli.edit_world import EDIT_WORLD, edit_size, edits_per_kind, folder_world, refuse_shapes_flags, run_world
from diffrl.cli.runs import Run, describe, fill_from_run, find_run, held_out_protocol
from diffrl.data.prompts import PromptRecord, check_input_key, load_prompts, prompt_file
from diffrl.data.shapes import EDIT_KINDS, prompts_by_category, test_prompts, train_prompts
from diffrl.evaluation.reward_eval import evaluate_with_reward, reward_components
from diffrl.evaluation.sampling import TEST_SEED
from diffrl.evaluation.shapes import (IMAGES_DIR, RECORDS_FILE, balanced_eval_set, clear_samples, evaluate_prompts,
                                     format_summary, mean_se, records_as_dicts, save_records_grid, save_samples,
                                     summarize)
from diffrl.errors import RequestError
from diffrl.models.checkpoint import load_model
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.models.registry import resolve_family
from diffrl.models.speed import SpeedOptions
from diffrl.rewards import check_prompts, default_device
from diffrl.train.config import MIN_CONDITION_IMAGE_SIZE
from diffrl.evaluation.shapes_edit import DEFAULT_SIZE, evaluate_held_out
from diffrl.utils.atomic import atomic_path, write_text_atomic
from diffrl.utils.device import resolve_device
from diffrl.utils.folders import check_fresh_output_dir, stamped_output_dir
from diffrl.utils.size import sample_size, size_flags

SHAPES_GUIDANCE_SCALE = 3.0  # the shapes evaluation's CFG when --guidance-scale is left unset


# Flags of one kind of evaluation and what the other kind takes instead (None: nothing).
_SHAPES_ONLY = {"split": None, "max_prompts_per_category": "--num-prompts", "num_seeds": "--n-samples-per-eval-prompt",
                "images_per_category": "--n-samples-per-eval-prompt"}
_PROMPT_DATA_ONLY = {"input_key": None, "num_prompts": "--max-prompts-per-category",
                     "n_samples_per_eval_prompt": "--num-seeds", "reward_device": None, "negative_prompt": None,
                     "reward_frames": None}


def _or_run(value):
    """A flag's value, or "run" (`load_model`: the checkpoint's run's value) when it was not given."""
    return "run" if value is None else value


def refuse_other_mode(cfg, flags: dict[str, str | None], prompt_data: bool) -> None:
    """A ValueError naming the first flag of `flags` set away from its default: a flag of the shapes evaluation given
    with --prompt-data, or the reverse, which the command would ignore. Names the flag this mode takes instead."""
    from dataclasses import MISSING, fields

    for f in fields(cfg):
        if f.name in flags and f.default is not MISSING and getattr(cfg, f.name) != f.default:
            flag, instead = "--" + f.name.replace("_", "-"), flags[f.name]
            if prompt_data:
                raise ValueError(f"{flag} is for the shapes world, not --prompt-data"
                                 + (f": with --prompt-data use {instead}" if instead else ""))
            raise ValueError(f"{flag} goes with --prompt-data and --reward (without them the shapes world is used)"
                             + (f"; the shapes world's is {instead}" if instead else ""))


_AT_LEAST_ONE = ("num_steps", "batch_size", "num_seeds", "num_prompts", "images_per_category", "max_prompts_per_category",
                 "num_frames", "reward_frames")
_NOT_NEGATIVE = ("guidance_scale", "guidance_scale_2", "base_guidance_scale", "trained_guidance_scale", "tie_margin")


def check_values(cfg) -> None:
    """The numbers of an evaluate or compare config that no model could take, refused naming the flag before any
    model loads (a step count of 0 or a negative CFG scale reached the engine's request schema as a pydantic error
    of four lines after the model loaded; --num-seeds 0 failed with a torch traceback). Also the size flags."""
    for name in _AT_LEAST_ONE + _NOT_NEGATIVE:
        value, least = getattr(cfg, name, None), 1 if name in _AT_LEAST_ONE else 0
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    side = getattr(cfg, "condition_image_size", None)
    if side is not None and side < MIN_CONDITION_IMAGE_SIZE:
        raise ValueError(f"--condition-image-size must be at least {MIN_CONDITION_IMAGE_SIZE} pixels, got {side}")
    sample_size(getattr(cfg, "resolution", None), getattr(cfg, "height", None), getattr(cfg, "width", None))


def check_family_values(cfg, family) -> None:
    """What the loaded family decides, named by flag: the size it can make, and a second expert's CFG scale."""
    size = sample_size(cfg.resolution, cfg.height, cfg.width)
    if size is not None:
        try:
            if family.generates_video:
                family.check_size(*size, num_frames=cfg.num_frames or family.default_num_frames)
            else:
                family.check_size(*size)
        except RequestError as err:
            raise ValueError(f"{size_flags(cfg.resolution, cfg.height, cfg.width)}: {err.message}") from None
    if cfg.guidance_scale_2 is not None and not family.uses_guidance_scale_2:
        raise ValueError(f"--guidance-scale-2 {cfg.guidance_scale_2}: the {family.name} family has no second expert "
                         "(this checkpoint); use --guidance-scale")


def check_shapes_family(family: str | None, model_path: Path, command: str, guidance_scale_2: float | None) -> None:
    """The shapes world verifies images: a video family is refused before it loads (its [C, F, H, W] videos
    reached the image writer as a traceback), pointing at the prompt-set evaluation, which takes video; and so
    is a second expert's CFG scale, which its one-expert models have no use for."""
    family_cls = resolve_family(family, model_path)
    if family_cls.generates_video:
        raise ValueError(f"diffrl {command}: the shapes world scores images and the {family_cls.name} family "
                         "generates video; pass --prompt-data PATH --reward SPEC (e.g. temporal_consistency)")
    if guidance_scale_2 is not None:
        raise ValueError("--guidance-scale-2: the shapes world's models have one expert; pass --prompt-data for Wan2.2")


_SAMPLING_FROM_RUN = {"model_path": "model_path", "diffusion_model_family": "diffusion_model_family",
                      "num_steps": "num_steps", "guidance_scale": "guidance_scale", "guidance_scale_2": "guidance_scale_2",
                      "num_frames": "num_frames", "condition_image_size": "condition_image_size"}
_SIZE = {"resolution": "resolution", "height": "height", "width": "width"}


def run_settings(cfg, run: Run, prompt_data: bool, skip: tuple[str, ...] = ()):
    """`cfg` with what its flags left unset taken from the run (model, family, size, steps, CFG; the size only when
    no size flag is given, the family only with the run's own model), so the run is judged the way it sampled its held-out evaluation."""
    names = dict(_SAMPLING_FROM_RUN)
    model = getattr(cfg, "model_path", None) if hasattr(cfg, "model_path") else getattr(cfg, "base", None)
    if not hasattr(cfg, "model_path"):  # compare: the base is --base
        names.pop("model_path")
    if model is not None:  # a model given by flag is detected as its own family, not the run's
        names.pop("diffusion_model_family")
    for name in skip:
        names.pop(name, None)
    if cfg.resolution is None and cfg.height is None and cfg.width is None:
        names.update(_SIZE)
    if prompt_data:
        names["reward_frames"] = "reward_frames"
    cfg = fill_from_run(cfg, run, names)
    if prompt_data and run.folder is not None and not cfg.negative_prompt:
        cfg = replace(cfg, negative_prompt=run.get("negative_prompt", ""))
    return cfg


def run_prompt_set(cfg, run: Run):
    """A prompt-set run's held-out prompts, reward, prompt key and counts where no --prompt-data or --reward is
    given (evaluate's and compare's configs)."""
    if run.folder is None or cfg.prompt_data is not None or cfg.reward is not None or not run.get("prompt_data"):
        return cfg
    cfg = replace(cfg, prompt_data=Path(run.get("eval_prompt_data") or run.get("prompt_data")),
                  reward=run.get("reward"))
    if cfg.input_key == "prompt":
        cfg = replace(cfg, input_key=run.get("input_key", "prompt"))
    if cfg.num_prompts is None and run.get("eval_num_prompts", 0) > 0:
        cfg = replace(cfg, num_prompts=run.get("eval_num_prompts"))
    if cfg.n_samples_per_eval_prompt == 1:
        cfg = replace(cfg, n_samples_per_eval_prompt=run.get("n_samples_per_eval_prompt", 1))
    if cfg.eval_reward is None and run.get("eval_reward"):  # the run's held-out judge
        cfg = replace(cfg, eval_reward=run.get("eval_reward"))
    return cfg


def resolve_run(cfg: EvaluateConfig) -> tuple[EvaluateConfig, Run]:
    """The run or checkpoint to evaluate (positional or --checkpoint), and the config with the run's settings filled
    in where no flag set them: its prompt set and reward, or the shapes world's held-out images and seeds."""
    if cfg.run is not None and cfg.checkpoint is not None:
        raise ValueError(f"pass the run folder ({cfg.run}) or --checkpoint, not both")
    run = find_run(cfg.checkpoint if cfg.checkpoint is not None else cfg.run)
    cfg = replace(cfg, run=None, checkpoint=run.checkpoint)
    cfg = run_prompt_set(cfg, run)
    prompt_data = cfg.prompt_data is not None or cfg.reward is not None
    cfg = run_settings(cfg, run, prompt_data)
    if not prompt_data:
        world = run_world(cfg, run) or folder_world(cfg.model_path or SHIPPED_DEMO_MODEL, cfg.diffusion_model_family)
        cfg = replace(cfg, world=world)
        if world == EDIT_WORLD:  # the task's fixed held-out edits: only their number is the run's
            cfg = edits_per_kind(cfg, run)
            return replace(cfg, model_path=cfg.model_path or SHIPPED_DEMO_MODEL,
                           num_steps=10 if cfg.num_steps is None else cfg.num_steps), run
    shapes_protocol_given = any(v is not None for v in (cfg.num_seeds, cfg.images_per_category,
                                                        cfg.max_prompts_per_category, cfg.seed))
    if run.folder is not None and not prompt_data and not shapes_protocol_given and cfg.split == "test":
        # The run's held-out images: its images per category at the trainer's held-out seeds.
        cfg = replace(cfg, images_per_category=run.get("eval_images_per_category") or 8, seed=TEST_SEED)
    return replace(cfg, model_path=cfg.model_path or SHIPPED_DEMO_MODEL,
                   num_steps=10 if cfg.num_steps is None else cfg.num_steps), run


def evaluate(cfg: EvaluateConfig) -> dict:
    if cfg.output_dir is None:
        cfg = replace(cfg, output_dir=stamped_output_dir("eval", cfg.checkpoint or cfg.run))
    check_fresh_output_dir(cfg.output_dir, cfg.overwrite)  # before the images are made, not after
    cfg, run = resolve_run(cfg)
    check_values(cfg)
    if cfg.prompt_data is not None or cfg.reward is not None:
        refuse_other_mode(cfg, _SHAPES_ONLY, prompt_data=True)
        if cfg.world is not None:
            raise ValueError(f"--world {cfg.world} is the world evaluated without --prompt-data; pass one of them")
        return evaluate_prompt_data(cfg)
    refuse_other_mode(cfg, _PROMPT_DATA_ONLY, prompt_data=False)
    if cfg.world == EDIT_WORLD:
        return evaluate_edit_world(cfg, run)
    if cfg.images_per_category is not None and cfg.num_seeds is not None:
        raise ValueError("--images-per-category sets the seeds per prompt itself: pass it or --num-seeds, not both")
    check_shapes_family(cfg.diffusion_model_family, cfg.model_path, "evaluate", cfg.guidance_scale_2)
    cfg = replace(cfg, seed=0 if cfg.seed is None else cfg.seed,
                  guidance_scale=SHAPES_GUIDANCE_SCALE if cfg.guidance_scale is None else cfg.guidance_scale)
    device = resolve_device(cfg.device)
    family = load_model(cfg.model_path, cfg.checkpoint, family=cfg.diffusion_model_family, device=device,
                        flow_shift=_or_run(cfg.flow_shift),
                        condition_image_size=_or_run(cfg.condition_image_size))
    check_family_values(cfg, family)
    SpeedOptions(float8=cfg.float8).apply(family)
    if cfg.max_prompts_per_category is None:
        prompts = test_prompts() if cfg.split == "test" else train_prompts()
    else:
        groups = prompts_by_category(cfg.split).values()
        prompts = [p for group in groups for p in group[: cfg.max_prompts_per_category]]
    seeds: int | list[int] = 4 if cfg.num_seeds is None else cfg.num_seeds
    if cfg.images_per_category is not None:
        prompts, seeds = balanced_eval_set(prompts, cfg.images_per_category)
    images_total = seeds * len(prompts) if isinstance(seeds, int) else sum(seeds)
    print(f"evaluating {describe(run) if cfg.checkpoint else cfg.model_path} on {len(prompts)} {cfg.split} prompts, {images_total} images "
          f"({cfg.num_steps} ODE steps, CFG {cfg.guidance_scale}, {device})")
    records, images = evaluate_prompts(
        family, prompts, num_seeds=seeds, seed=cfg.seed, num_steps=cfg.num_steps,
        guidance_scale=cfg.guidance_scale, batch_size=cfg.batch_size, progress=True, resolution=cfg.resolution,
        height=cfg.height, width=cfg.width,
    )
    summary = summarize(records)
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    # Every file goes under a temporary name and is renamed; report.json goes last, so a folder
    # without it is an evaluation that did not finish.
    (out / "report.json").unlink(missing_ok=True)
    (out / "samples.jsonl").unlink(missing_ok=True)  # records.jsonl's name before the one naming scheme
    if cfg.save_images:
        save_samples(records, images, out)  # records.jsonl: each row also names its image
    else:
        clear_samples(out)  # never leave an earlier run's images beside this run's report
        rows = [{"index": k, **row} for k, row in enumerate(records_as_dicts(records))]
        write_text_atomic(out / "records.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    report = {"config": {k: str(v) for k, v in asdict(cfg).items()}, **summary}
    with atomic_path(out / "grid.png") as tmp:
        save_records_grid(records, images, tmp, limit=64)
    write_text_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    print(format_summary(summary))
    saved = f"  images: {out / IMAGES_DIR}" if cfg.save_images else ""
    print(f"report: {out / 'report.json'}  records: {out / RECORDS_FILE}  grid: {out / 'grid.png'}{saved}")
    return report


def check_edit_family(family) -> None:
    """The editing world gives every prompt a source image: a family that takes none is refused by name."""
    if not family.accepts_image_conditioning:
        raise ValueError(f"--world shapes-edit gives every prompt a source image; the {family.name} family at this "
                         "checkpoint takes none (use an editing model, e.g. diffrl/assets/demo-shapes-edit)")


def kind_figures(rows: list[dict]) -> dict[str, dict]:
    """Per edit kind: its held-out images, strict accuracy with its standard error, and mean partial credit."""
    figures = {}
    for kind in EDIT_KINDS:
        mine = [r for r in rows if r["metadata"]["edit_kind"] == kind]
        if mine:
            strict, strict_se = mean_se([float(r["rewards"]["strict"]) for r in mine])
            figures[kind] = {"n": len(mine), "strict": strict, "strict_se": strict_se,
                             "score": sum(r["rewards"]["score"] for r in mine) / len(mine)}
    return figures


def evaluate_edit_world(cfg: EvaluateConfig, run: Run) -> dict:
    """The editing world's held-out evaluation (`ShapesEditTask.evaluate`'s, the same function): the run's
    --eval-images-per-category edits of each kind at the task's seeds, its steps, CFG, size and negative prompt,
    so a run's figures come back exactly. Files as any prompt-set evaluation's (report.json last)."""
    refuse_shapes_flags(cfg, {"split": "test", "max_prompts_per_category": None, "num_seeds": None, "seed": None})
    check_shapes_family(cfg.diffusion_model_family, cfg.model_path, "evaluate", cfg.guidance_scale_2)
    size = edit_size(cfg) or DEFAULT_SIZE
    cfg = replace(cfg, guidance_scale=SHAPES_GUIDANCE_SCALE if cfg.guidance_scale is None else cfg.guidance_scale)
    negative_prompt = held_out_protocol(run).get("negative_prompt", "")
    device = resolve_device(cfg.device)
    family = load_model(cfg.model_path, cfg.checkpoint, family=cfg.diffusion_model_family, device=device,
                        flow_shift=_or_run(cfg.flow_shift),
                        condition_image_size=_or_run(cfg.condition_image_size))
    check_edit_family(family)
    check_family_values(replace(cfg, resolution=size, height=None, width=None), family)
    SpeedOptions(float8=cfg.float8).apply(family)
    per_kind = cfg.images_per_category
    print(f"evaluating {describe(run) if cfg.checkpoint else cfg.model_path} on the editing world's held-out edits, "
          f"{per_kind} of each kind at {size}x{size} ({cfg.num_steps} ODE steps, CFG {cfg.guidance_scale}, {device})")
    out = cfg.output_dir
    metrics, result = evaluate_held_out(family, per_kind, size, num_steps=cfg.num_steps,
                                        guidance_scale=cfg.guidance_scale, negative_prompt=negative_prompt,
                                        out_dir=out, batch_size=cfg.batch_size, progress=True)
    kinds = kind_figures(result.rows)
    report = {"config": {k: str(v) for k, v in asdict(cfg).items()}, "world": EDIT_WORLD, "size": size,
              "negative_prompt": negative_prompt, "n_images": len(result.rows), **metrics, "kinds": kinds}
    write_text_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")  # replaces the sampler's own
    print(f"{'edit kind':<10} {'n':>5}  {'strict':>15}  {'score':>6}")
    for kind, k in kinds.items():
        print(f"{kind:<10} {k['n']:>5}  {k['strict']:>6.3f} ± {k['strict_se']:.3f}  {k['score']:>6.3f}")
    print(f"{'all':<10} {len(result.rows):>5}  {metrics['eval/strict']:>6.3f}{'':>8}  {metrics['eval/score']:>6.3f}")
    print(f"report: {out / 'report.json'}  records: {out / 'records.jsonl'}  grid: {out / 'grid.png'}  "
          f"images: {out / 'images'}")
    return report


def eval_prompts(prompt_data: Path | None, reward: str | None, input_key: str, num_prompts: int | None,
                 n_samples_per_eval_prompt: int) -> list[PromptRecord]:
    """The first `num_prompts` prompts of `--prompt-data` (a directory's test split), after checking the
    flags that go with it; shared by `diffrl evaluate` and `diffrl compare`."""
    if prompt_data is None:
        raise ValueError("--reward scores a prompt set: also pass --prompt-data PATH")
    if not reward:
        raise ValueError("--prompt-data needs --reward SPEC (e.g. ocr, pickscore@/path, multi:ocr=1,jpeg_compressibility=0.5)")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if n_samples_per_eval_prompt < 1:
        raise ValueError(f"--n-samples-per-eval-prompt must be >= 1, got {n_samples_per_eval_prompt}")
    records = load_prompts(prompt_data, split="test", input_key=input_key)
    check_input_key(input_key, {f"--prompt-data {prompt_data}": prompt_file(prompt_data, "test")})
    records = records[:num_prompts] if num_prompts is not None else records
    check_prompts(reward, [r.prompt for r in records], f"prompt data {prompt_data}")
    return records


def evaluate_prompt_data(cfg: EvaluateConfig) -> dict:
    records = eval_prompts(cfg.prompt_data, cfg.reward, cfg.input_key, cfg.num_prompts, cfg.n_samples_per_eval_prompt)
    if cfg.reward_device != "auto":
        default_device(cfg.reward_device)  # a GPU this machine lacks, whichever reward
    components = reward_components(cfg.reward, device=cfg.reward_device)  # a bad spec fails before any model loads
    judges = None if cfg.eval_reward is None else reward_components(cfg.eval_reward, device=cfg.reward_device)
    if cfg.eval_reward is not None:
        check_prompts(cfg.eval_reward, [r.prompt for r in records], f"--eval-reward: prompt data {cfg.prompt_data}")
    device = resolve_device(cfg.device)
    family = load_model(cfg.model_path, cfg.checkpoint, family=cfg.diffusion_model_family, device=device,
                        flow_shift=_or_run(cfg.flow_shift),
                        condition_image_size=_or_run(cfg.condition_image_size))
    check_family_values(cfg, family)
    SpeedOptions(float8=cfg.float8).apply(family)
    cfg = replace(cfg, seed=TEST_SEED if cfg.seed is None else cfg.seed,
                  guidance_scale=family.default_guidance_scale if cfg.guidance_scale is None else cfg.guidance_scale)
    total = len(records) * cfg.n_samples_per_eval_prompt
    print(f"evaluating {cfg.checkpoint or cfg.model_path} on {len(records)} prompts of {cfg.prompt_data}, {total} images "
          f"({cfg.num_steps} ODE steps, CFG {cfg.guidance_scale}, {device}), reward {cfg.reward}"
          + (f", judge {cfg.eval_reward}" if cfg.eval_reward else ""))
    result = evaluate_with_reward(
        family, records, components, seeds_per_prompt=cfg.n_samples_per_eval_prompt, seed=cfg.seed,
        num_steps=cfg.num_steps, guidance_scale=cfg.guidance_scale, guidance_scale_2=cfg.guidance_scale_2,
        resolution=cfg.resolution, height=cfg.height,
        width=cfg.width, num_frames=cfg.num_frames, reward_frames=cfg.reward_frames,
        negative_prompt=cfg.negative_prompt, batch_size=cfg.batch_size, out_dir=cfg.output_dir, progress=True,
        judge=judges)
    width = max(len(k) for k in result.summary)
    for key, value in result.summary.items():
        print(f"{key:<{width}}  {value:.4f}")
    out = cfg.output_dir
    print(f"report: {out / 'report.json'}  records: {out / 'records.jsonl'}  grid: {out / 'grid.png'}  "
          f"images: {out / 'images'}")
    return {"config": {k: str(v) for k, v in asdict(cfg).items()}, **result.summary}
