"""`diffrl compare`: a trained checkpoint against the base model.

Two kinds: the shapes world's first test prompts (the default), or, with `--prompt-data PATH --reward
SPEC`, the first `--num-prompts` prompts of a prompt set through three columns on the same seeds (the
base with CFG, the base without CFG, the trained model), a win/tie/loss per prompt by mean reward with
a stated `--tie-margin`, `report.md`, `report.json` and a side-by-side grid (`compare.md` and `compare.json`
before the one naming scheme of `diffrl.utils.output_files`).
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, replace
from pathlib import Path

from diffrl.cli.configs import CompareConfig
from diffrl.cli.edit_world import (EDIT_WORLD, edit_size, edits_per_kind, folder_world, refuse_shapes_flags,
                                   run_world)
from diffrl.cli.evaluate import (check_edit_family, check_family_values, check_shapes_family, check_values, eval_prompts,
                                 refuse_other_mode, run_prompt_set, run_settings)
from diffrl.cli.runs import find_run, held_out_protocol
from diffrl.data.shapes import test_prompts
from diffrl.evaluation.compare import (MEASURABLE_SE, REWARD_COLUMNS, compare_by_reward, compare_models, format_paired,
                                       paired_groups, paired_strict, reward_markdown, rows_as_dicts, save_reward_side_by_side,
                                       save_side_by_side, tally)
from diffrl.evaluation.reward_eval import evaluate_with_reward, reward_components, with_sources
from diffrl.evaluation.sampling import TEST_SEED
from diffrl.evaluation.shapes import balanced_eval_set, summarize
from diffrl.models.checkpoint import check_checkpoint, check_fits, load_model
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.rewards import default_device
from diffrl.evaluation.shapes_edit import DEFAULT_SIZE, evaluate_held_out
from diffrl.utils.atomic import atomic_path, write_text_atomic
from diffrl.utils.device import resolve_device
from diffrl.utils.folders import check_fresh_output_dir, stamped_output_dir
from diffrl.utils.images import save_grid


def resolve_run(cfg: CompareConfig) -> CompareConfig:
    """The trained run or checkpoint (positional or --trained) and the settings its run's config.json gives where
    no flag did: the base model, family, steps, size and the CFG the run sampled its held-out images at."""
    if cfg.run is not None and cfg.trained is not None:
        raise ValueError(f"pass the trained run ({cfg.run}) or --trained, not both")
    if cfg.run is None and cfg.trained is None:
        raise ValueError("diffrl compare needs the trained model: a run folder (diffrl compare RUN) or --trained PATH")
    run = find_run(cfg.trained if cfg.trained is not None else cfg.run)
    cfg = run_prompt_set(replace(cfg, run=None, trained=run.checkpoint), run)
    prompt_data = cfg.prompt_data is not None or cfg.reward is not None
    if run.folder is not None:
        run_cfg = held_out_protocol(run)["guidance_scale"]
        if cfg.trained_guidance_scale is None:  # the trained model as its run sampled
            cfg = replace(cfg, trained_guidance_scale=run_cfg)
        if cfg.guidance_scale is None and (not prompt_data or (run_cfg or 0) > 1):
            cfg = replace(cfg, guidance_scale=run_cfg)  # the base too (with --prompt-data: its CFG column)
        own_base = cfg.base is None
        cfg = run_settings(cfg, run, prompt_data, skip=("guidance_scale",))  # with --base: that model's family
        if own_base and run.get("model_path"):
            cfg = replace(cfg, base=Path(run.get("model_path")))
    if not prompt_data:
        world = run_world(cfg, run) or folder_world(cfg.base or SHIPPED_DEMO_MODEL, cfg.diffusion_model_family)
        cfg = replace(cfg, world=world)
        if world == EDIT_WORLD:  # the run's held-out edits of each kind, or more
            cfg = edits_per_kind(cfg, run, least=8)
    if run.folder is not None:
        if (not prompt_data and cfg.world != EDIT_WORLD and cfg.images_per_category is None and cfg.num_prompts is None
                and cfg.num_seeds is None):  # the run's held-out images, or more
            cfg = replace(cfg, images_per_category=max(8, run.get("eval_images_per_category", 0)))
    return replace(cfg, base=cfg.base or SHIPPED_DEMO_MODEL, num_steps=10 if cfg.num_steps is None else cfg.num_steps)


def compare(cfg: CompareConfig) -> dict:
    if cfg.output_dir is None:
        cfg = replace(cfg, output_dir=stamped_output_dir("compare", cfg.trained or cfg.run))
    check_fresh_output_dir(cfg.output_dir, cfg.overwrite)  # before the images are made, not after
    cfg = resolve_run(cfg)
    check_values(cfg)
    # The trained model loads after the base model's images are made: a wrong path must fail before them.
    check_checkpoint(cfg.trained)
    if cfg.base_checkpoint is not None:
        check_checkpoint(cfg.base_checkpoint)
    if cfg.prompt_data is not None or cfg.reward is not None:
        refuse_other_mode(cfg, {"num_seeds": "--n-samples-per-eval-prompt", "images_per_category": "--num-prompts",
                                "base_guidance_scale": "--guidance-scale (the base with CFG; without CFG it runs at 1)"},
                          prompt_data=True)
        if cfg.world is not None:
            raise ValueError(f"--world {cfg.world} is the world compared without --prompt-data; pass one of them")
        return compare_by_prompt_data(cfg)
    refuse_other_mode(cfg, {"input_key": None, "tie_margin": None, "n_samples_per_eval_prompt": "--num-seeds",
                            "reward_device": None, "negative_prompt": None, "reward_frames": None,
                            "num_frames": None, "condition_image_size": None}, prompt_data=False)
    if cfg.world == EDIT_WORLD:
        return compare_edit_world(cfg)
    check_shapes_family(cfg.diffusion_model_family, cfg.base, "compare", cfg.guidance_scale_2)
    device = resolve_device(cfg.device)
    base = load_model(cfg.base, cfg.base_checkpoint, family=cfg.diffusion_model_family, device=device)
    trained = load_model(cfg.base, cfg.trained, family=cfg.diffusion_model_family, device=device)
    if cfg.num_prompts is not None or cfg.num_seeds is not None:
        if cfg.images_per_category is not None:
            raise ValueError("--images-per-category shares the images over each category's prompts: pass it or "
                             "--num-prompts/--num-seeds, not both")
        prompts, seeds = test_prompts()[: 32 if cfg.num_prompts is None else cfg.num_prompts], cfg.num_seeds or 1
        seed = 0 if cfg.seed is None else cfg.seed
        protocol = f"the first {len(prompts)} test prompts × {seeds} seeds"
    else:
        per_category = 16 if cfg.images_per_category is None else cfg.images_per_category
        prompts, seeds = balanced_eval_set(test_prompts(), per_category)
        seed = TEST_SEED if cfg.seed is None else cfg.seed
        protocol = f"at least {per_category} images per category over the test prompts"
    guidance = 1.0 if cfg.guidance_scale is None else cfg.guidance_scale
    base_cfg = guidance if cfg.base_guidance_scale is None else cfg.base_guidance_scale
    trained_cfg = guidance if cfg.trained_guidance_scale is None else cfg.trained_guidance_scale
    total = seeds * len(prompts) if isinstance(seeds, int) else sum(seeds)
    print(f"comparing {cfg.trained} with {cfg.base_checkpoint or cfg.base} on {total} images ({protocol}, seeds "
          f"{seed}…{seed + total - 1}), {cfg.num_steps} ODE steps, CFG base {base_cfg:g} / trained {trained_cfg:g}")
    rows, base_records, trained_records, base_images, trained_images = compare_models(
        base, trained, prompts, seed=seed, num_seeds=seeds, num_steps=cfg.num_steps,
        base_guidance_scale=base_cfg, trained_guidance_scale=trained_cfg, resolution=cfg.resolution, height=cfg.height,
        width=cfg.width, progress=True)
    counts = tally(rows)
    paired = paired_strict(base_records, trained_records)
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    grid = save_side_by_side(base_records, trained_records, base_images, trained_images, out / "side_by_side.png")
    report = {
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "images": total,
        "guidance_scales": {"base": base_cfg, "trained": trained_cfg},
        "strict": paired,
        "win_tie_loss": counts,
        "base": summarize(base_records),
        "trained": summarize(trained_records),
        "prompts": rows_as_dicts(rows),
    }
    write_text_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    print(f"{'prompt':<48} {'base':>9} {'trained':>9}  outcome")
    for r in rows:
        print(f"{r.prompt:<48} {r.base_strict}/{r.n} {r.base_score:.2f} {r.trained_strict}/{r.n} "
              f"{r.trained_score:.2f}  {r.outcome}")
    print(f"per prompt: {counts['win']} wins, {counts['tie']} ties, {counts['loss']} losses over {len(rows)} prompts")
    print(format_paired(paired))
    s = paired["per_sample"]
    print(f"verdict over {s['n']} images: {s['verdict']} (trained − base {s['difference']:+.3f} ± {s['difference_se']:.3f}; "
          f"a difference is called beyond {MEASURABLE_SE:g} standard errors"
          + ("; more images: --images-per-category N)" if s["verdict"] == "no measurable difference" else ")"))
    print(f"report: {out / 'report.json'}  grid: {grid}")
    return report


def compare_edit_world(cfg: CompareConfig) -> dict:
    """The editing world: both models on the task's held-out edits (--images-per-category of each kind, its fixed
    seeds, the run's steps, CFG and size), each image strictly verified against its source; strict accuracy per
    edit kind, per sample and over kinds, each with counts, standard errors and a verdict only beyond
    MEASURABLE_SE of them (`paired_groups`, as the shapes world's `paired_strict`). Each model's evaluation in
    base/ and trained/ (records.jsonl, images, grid.png, report.json); report.json, report.md and side_by_side.png."""
    import torch

    refuse_shapes_flags(cfg, {"num_prompts": None, "num_seeds": None, "seed": None})
    check_shapes_family(cfg.diffusion_model_family, cfg.base, "compare", cfg.guidance_scale_2)
    size = edit_size(cfg) or DEFAULT_SIZE
    guidance = 1.0 if cfg.guidance_scale is None else cfg.guidance_scale
    scales = {"base": guidance if cfg.base_guidance_scale is None else cfg.base_guidance_scale,
              "trained": guidance if cfg.trained_guidance_scale is None else cfg.trained_guidance_scale}
    per_kind, device, out = cfg.images_per_category, resolve_device(cfg.device), cfg.output_dir
    negative_prompt = held_out_protocol(find_run(cfg.trained)).get("negative_prompt", "")  # the run's, if any
    total = 4 * per_kind
    print(f"comparing {cfg.trained} with {cfg.base_checkpoint or cfg.base} on the editing world's held-out edits, "
          f"{per_kind} of each kind ({total} images, seeds {TEST_SEED}…{TEST_SEED + total - 1}) at {size}x{size}, "
          f"{cfg.num_steps} ODE steps, CFG base {scales['base']:g} / trained {scales['trained']:g}")
    results, metrics = {}, {}
    for column, checkpoint in (("base", cfg.base_checkpoint), ("trained", cfg.trained)):
        # One model at a time: a large family's base and trained copies need not fit together.
        family = load_model(cfg.base, checkpoint, family=cfg.diffusion_model_family, device=device)
        check_edit_family(family)
        check_family_values(replace(cfg, resolution=size, height=None, width=None), family)
        metrics[column], results[column] = evaluate_held_out(
            family, per_kind, size, num_steps=cfg.num_steps, guidance_scale=scales[column],
            negative_prompt=negative_prompt, out_dir=out / column, batch_size=cfg.batch_size, progress=True)
        del family
        gc.collect()
    base_rows, trained_rows = results["base"].rows, results["trained"].rows
    kinds = [r["metadata"]["edit_kind"] for r in base_rows]
    paired = paired_groups(kinds, [float(r["rewards"]["strict"]) for r in base_rows],
                           [float(r["rewards"]["strict"]) for r in trained_rows])
    score = paired_groups(kinds, [float(r["rewards"]["score"]) for r in base_rows],
                          [float(r["rewards"]["score"]) for r in trained_rows])
    shown = min(32, total)
    cells = torch.stack([image for k in range(shown) for image in (results["base"].images[k],
                                                                   results["trained"].images[k])])
    captions = [f"{column} {'ok' if rows[k]['rewards']['strict'] else 'X'} {rows[k]['rewards']['score']:.2f} | "
                f"{rows[k]['prompt']}" for k in range(shown)
                for column, rows in (("base", base_rows), ("trained", trained_rows))]
    cells, captions = with_sources(cells, captions, results["trained"].sources, columns=2)
    grid = out / "side_by_side.png"
    with atomic_path(grid) as tmp:
        save_grid(cells, tmp, ncols=6, captions=captions, caption_lines=3)
    table = format_paired(paired, group="kind")
    s = paired["per_sample"]
    verdict_line = (f"verdict over {s['n']} edits: {s['verdict']} (trained − base {s['difference']:+.3f} ± "
                    f"{s['difference_se']:.3f}; a difference is called beyond {MEASURABLE_SE:g} standard errors"
                    + ("; more edits: --images-per-category N)" if s["verdict"] == "no measurable difference" else ")"))
    report = {
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "world": "shapes-edit",
        "images": total,
        "size": size,
        "guidance_scales": scales,
        "strict": paired,  # "categories": the edit kinds
        "score": score,
        "base": metrics["base"],
        "trained": metrics["trained"],
    }
    write_text_atomic(out / "report.md", f"# {cfg.trained} vs {cfg.base_checkpoint or cfg.base}: editing world\n\n"
                      f"```\n{table}\n```\n\n{verdict_line}\n")
    write_text_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    print(table)
    print(verdict_line)
    print(f"report: {out / 'report.md'}  {out / 'report.json'}  grid: {grid}  evaluations: {out / 'base'}, "
          f"{out / 'trained'}")
    return report


def compare_by_prompt_data(cfg: CompareConfig) -> dict:
    records = eval_prompts(cfg.prompt_data, cfg.reward, cfg.input_key, cfg.num_prompts, cfg.n_samples_per_eval_prompt)
    if cfg.reward_device != "auto":
        default_device(cfg.reward_device)  # a GPU this machine lacks, whichever reward
    components = reward_components(cfg.reward, device=cfg.reward_device)  # a bad spec fails before any model loads
    judges = None if cfg.eval_reward is None else reward_components(cfg.eval_reward, device=cfg.reward_device)
    device = resolve_device(cfg.device)
    seed = TEST_SEED if cfg.seed is None else cfg.seed
    out = cfg.output_dir
    # The models one at a time: a large family's base and trained copies need not fit together. Both take one
    # condition image size (None: the pipeline's), not each its own run's.
    sized = dict(condition_image_size=cfg.condition_image_size)
    base = load_model(cfg.base, cfg.base_checkpoint, family=cfg.diffusion_model_family, device=device, **sized)
    check_family_values(cfg, base)
    if cfg.base_checkpoint is None:
        check_fits(base, cfg.base, cfg.trained)  # before the base's images, not after
    guidance = base.default_guidance_scale if cfg.guidance_scale is None else cfg.guidance_scale
    if guidance <= 1.0:
        raise ValueError(f"--guidance-scale {guidance}: the base-with-CFG column needs a scale above 1")
    trained_guidance = guidance if cfg.trained_guidance_scale is None else cfg.trained_guidance_scale
    scales = {"base_cfg": guidance, "base_nocfg": 1.0, "trained": trained_guidance}
    scales_2 = {c: cfg.guidance_scale_2 if scale > 1 else None for c, scale in scales.items()}  # CFG columns only
    labels = {"base_cfg": f"base CFG {guidance:g}", "base_nocfg": "base no CFG",
              "trained": f"trained CFG {trained_guidance:g}"}
    common = dict(seeds_per_prompt=cfg.n_samples_per_eval_prompt, seed=seed, num_steps=cfg.num_steps,
                  resolution=cfg.resolution, height=cfg.height, width=cfg.width, num_frames=cfg.num_frames,
                  reward_frames=cfg.reward_frames, negative_prompt=cfg.negative_prompt,
                  batch_size=cfg.batch_size, progress=True, judge=judges)
    print(f"comparing {cfg.trained} with {cfg.base_checkpoint or cfg.base} on {len(records)} prompts of "
          f"{cfg.prompt_data} × {cfg.n_samples_per_eval_prompt} seeds ({cfg.num_steps} ODE steps, {device}), "
          f"reward {cfg.reward}")
    evals = {}
    for column in ("base_cfg", "base_nocfg"):
        evals[column] = evaluate_with_reward(base, records, components, guidance_scale=scales[column],
                                             guidance_scale_2=scales_2[column], out_dir=out / column, **common)
    del base
    gc.collect()
    trained = load_model(cfg.base, cfg.trained, family=cfg.diffusion_model_family, device=device, **sized)
    evals["trained"] = evaluate_with_reward(trained, records, components, guidance_scale=scales["trained"],
                                            guidance_scale_2=scales_2["trained"], out_dir=out / "trained", **common)
    rows, totals = compare_by_reward({c: evals[c].per_prompt() for c in REWARD_COLUMNS}, cfg.tie_margin)
    grid = save_reward_side_by_side(evals, labels, out / "side_by_side.png")
    report = {
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "guidance_scales": scales,
        "guidance_scales_2": scales_2,
        "summaries": {c: evals[c].summary for c in REWARD_COLUMNS},
        "totals": totals,
        "prompts": rows,
    }
    markdown = reward_markdown(rows, totals, labels)
    for stale in ("compare.md", "compare.json"):  # an --overwrite of a folder written before the one naming scheme
        (out / stale).unlink(missing_ok=True)
    write_text_atomic(out / "report.md", markdown)
    write_text_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    print(markdown, end="")
    if judges:
        print("judge (--eval-reward " + cfg.eval_reward + "): "
              + ", ".join(f"{labels[c]} {evals[c].summary['eval/judge']:.4f}" for c in REWARD_COLUMNS))
    print(f"report: {out / 'report.md'}  {out / 'report.json'}  grid: {grid}")
    return report
