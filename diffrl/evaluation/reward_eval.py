"""Held-out evaluation of any model on a prompt set, scored by any reward.

The first K prompts (the caller cuts them), each sampled `seeds_per_prompt` times by ODE at fixed
seeds: image k of the expanded list (each prompt repeated for its seeds, prompts in order) gets seed
`seed + k`, as `diffrl.evaluation.shapes` does, so any image can be regenerated alone. Each image is
scored by every reward component separately (`multi:a=wa,b=wb` has components a and b; any other
spec is one component) and by their weighted total. The reward sees each record's metadata plus
`{"seed": …}`, as in training.

On disk (`out_dir`): `images/00000.png`, … (a video as an animated PNG, lossless, all its frames at
the family's frame rate, else `VIDEO_FPS`), `records.jsonl` (one line per image), `grid.png` (the first images, a video's first frame,
captioned with prompt and reward; where records have condition images, each image follows its source), for videos `frames.png` (the first videos one per row, each as
evenly spaced frames) and `report.json` (the summary; `summary.json` before the one naming scheme of
`diffrl.utils.output_files`). Every file is written under a temporary name and renamed, and `report.json` goes
last: a directory without it is an evaluation that did not finish.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, PngImagePlugin
from diffrl.utils.progress import tqdm

from diffrl.data.condition_images import CONDITION_IMAGES_KEY, with_condition_images
from diffrl.data.prompts import PromptRecord, negative_prompt_of
from diffrl.evaluation.diversity import palette
from diffrl.evaluation.sampling import TEST_SEED, generate
from diffrl.models.base import FamilyAdapter
from diffrl.rewards import _parse_weights, checked_rewards, get_reward
from diffrl.rewards.frames import on_frames
from diffrl.rewards.groups import pointwise_spec
from diffrl.utils.atomic import atomic_path, write_text_atomic
from diffrl.utils.blocking import run_blocking
from diffrl.utils.images import fit_image, save_grid, to_uint8
from diffrl.utils.size import sample_size

GRID_IMAGES = 32
GRID_COLUMNS, GRID_CAPTION_LINES = 8, 3  # an evaluation grid's layout (`save_eval_grid`; scripts/palette.py reads it)
VIDEO_FPS = 16  # a video's playback rate when its family samples at none (Wan2.2: WanPipeline's export rate)


@dataclass(frozen=True)
class RewardComponent:
    """One scorer of a reward spec, its TensorBoard-safe name and its weight in the total."""

    name: str
    spec: str
    weight: float
    score: Callable


@dataclass
class RewardEval:
    """What an evaluation measured. `summary`: {"eval/reward": mean total, "eval/reward/<component>": mean};
    `rows`: one dict per image (index, prompt_index, prompt, metadata, seed, reward, rewards, file);
    `images`: [N, 3, H, W] (video: [N, 3, F, H, W]) in [0, 1] on CPU, in row order; `sources`: each row's first
    condition image ([3, h, w] in [0, 1]; None for a record without one; empty when no record has one)."""

    summary: dict[str, float]
    rows: list[dict]
    images: torch.Tensor
    components: list[RewardComponent] = field(default_factory=list)
    out_dir: Path | None = None
    sources: list[torch.Tensor | None] = field(default_factory=list)

    def per_prompt(self) -> list[dict]:
        """Per prompt (in order): its mean total reward and mean per component over its seeds."""
        by_prompt: dict[int, list[dict]] = {}
        for row in self.rows:
            by_prompt.setdefault(row["prompt_index"], []).append(row)
        return [{"prompt_index": i, "prompt": rows[0]["prompt"], "n": len(rows),
                 "reward": _mean(r["reward"] for r in rows),
                 "rewards": {c: _mean(r["rewards"][c] for r in rows) for c in rows[0]["rewards"]}}
                for i, rows in by_prompt.items()]


def tag_name(spec: str) -> str:
    """A component's name for metric tags: `pickscore@/x/y` → `pickscore`, `pkg.mod:fn` → `fn`."""
    name = spec.partition("@")[0]
    name = name.rpartition(":")[2] or name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name.strip()) or "reward"


def reward_components(reward: str | Callable | Sequence[RewardComponent],
                      device: str | None = None) -> list[RewardComponent]:
    """The components of a reward spec (`ocr`, `pickscore@/path`, `multi:ocr=1,jpeg_compressibility=0.5`,
    `module:function`; a group reward's `rank:ocr` is its pointwise `ocr`), of a scorer already built (one
    component, `reward`), or components as given.
    `device` (specs only): where model rewards load and score (`cpu`, `cuda:N`; None or `auto`: CUDA when
    present)."""
    if isinstance(reward, str):
        if reward.startswith("multi:"):
            weights = _parse_weights(reward.removeprefix("multi:"))
            parts = [(spec, w) for spec, w in weights.items()]
        else:
            parts = [(reward, 1.0)]
        components, seen = [], set()
        for spec, weight in parts:
            spec = pointwise_spec(spec)  # a group reward's ranks or novelty among one model's seeds judge nothing
            name = tag_name(spec)
            if name in seen:  # two components reduce to one tag (e.g. two pickscore checkpoints)
                name = f"{name}_{len(seen)}"
            seen.add(name)
            scorer = get_reward(spec, device=None if device == "auto" else device)
            components.append(RewardComponent(name, spec, weight, scorer))
        return components
    if callable(reward):
        return [RewardComponent("reward", getattr(reward, "__name__", "reward"), 1.0, reward)]
    components = list(reward)
    if not components or not all(isinstance(c, RewardComponent) for c in components):
        raise ValueError("reward: expected a spec string, a scorer or a list of RewardComponent")
    return components


def _resolve(values):
    """A scorer's result, awaited when it is a coroutine (also from inside a running event loop)."""
    if not inspect.isawaitable(values):
        return values
    return run_blocking(lambda: values)


def score_components(components: Sequence[RewardComponent], images: torch.Tensor, prompts: list[str],
                     metadata: list[dict]) -> tuple[list[float], list[dict[str, float]]]:
    """(total per image, {component: value} per image); total = Σ weight · component."""
    per_component = {}
    for c in components:
        per_component[c.name] = checked_rewards(_resolve(c.score(images, prompts, metadata)), len(prompts),
                                                f"reward {c.spec!r}", prompts)
    rewards = [{c.name: per_component[c.name][i] for c in components} for i in range(len(prompts))]
    totals = [sum(c.weight * r[c.name] for c in components) for r in rewards]
    return totals, rewards


@torch.no_grad()
def evaluate_with_reward(
    family: FamilyAdapter,
    records: Sequence[PromptRecord],
    reward: str | Callable | Sequence[RewardComponent],
    *,
    seeds_per_prompt: int = 1,
    seed: int = TEST_SEED,
    num_steps: int,
    guidance_scale: float,
    guidance_scale_2: float | None = None,
    resolution: int | None = None,
    num_frames: int | None = None,
    negative_prompt: str = "",
    batch_size: int = 16,
    out_dir: Path | None = None,
    progress: bool = False,
    reward_device: str | None = None,
    height: int | None = None,
    width: int | None = None,
    reward_frames: int | None = None,
    judge: str | Sequence[RewardComponent] | None = None,
) -> RewardEval:
    """Sample every record `seeds_per_prompt` times (image k: seed + k), score each image by every
    component and the total, and write everything under `out_dir` when given (see the module docstring).
    The size is `height` × `width` or the square `resolution` (None: the family's). `reward_device`: where
    a spec's model rewards load and score (None: CUDA when present). `reward_frames`: every component sees
    only this many evenly spaced frames of each video, as training's reward does (the files keep them all).
    `judge` (--eval-reward): a second reward, distinct from the trained one, that scores the same images (each
    row's `judge` and `judges`; `eval/judge`, `eval/judge/<component>`): where the trained reward rises and the
    judge does not, the model learned what the reward cannot see."""
    if not records:
        raise ValueError("evaluation: no prompts")
    if seeds_per_prompt < 1:
        raise ValueError(f"--n-samples-per-eval-prompt must be >= 1, got {seeds_per_prompt}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    sample_size(resolution, height, width)  # a contradictory size fails before any file is touched
    components = [replace(c, score=on_frames(c.score, reward_frames))
                  for c in reward_components(reward, device=reward_device)]
    judges = [] if judge is None else [replace(c, score=on_frames(c.score, reward_frames))
                                       for c in reward_components(judge, device=reward_device)]
    expanded = [(i, r) for i, r in enumerate(records) for _ in range(seeds_per_prompt)]
    seeds = [seed + k for k in range(len(expanded))]
    if out_dir is not None:
        out_dir = Path(out_dir)
        # Never mix an earlier evaluation's files with ours (a shorter rerun would leave its extra images).
        # The old names too: a folder written before the one naming scheme must not keep its summary.json.
        for stale in ("report.json", "records.jsonl", "grid.png", "frames.png", "summary.json", "samples.jsonl"):
            (out_dir / stale).unlink(missing_ok=True)
        (out_dir / "images").mkdir(parents=True, exist_ok=True)
        for stale in (out_dir / "images").glob("[0-9]*.png"):
            stale.unlink()
    was_training = family.transformer.training
    family.transformer.eval()  # the trainer hands over its live model: sample it in eval mode, then restore
    try:
        rows, images, sources = _sample_and_score(family, expanded, seeds, components, num_steps=num_steps,
                                         guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2,
                                         size={"resolution": resolution, "height": height, "width": width},
                                         num_frames=num_frames, negative_prompt=negative_prompt,
                                         batch_size=batch_size, out_dir=out_dir, progress=progress)
    finally:
        family.transformer.train(was_training)
    for start in range(0, len(rows) if judges else 0, batch_size):  # the judge reads the images just sampled
        part = rows[start : start + batch_size]
        totals, values = score_components(judges, images[start : start + len(part)], [r["prompt"] for r in part],
                                          [{**r["metadata"], "seed": r["seed"]} for r in part])
        for row, total, value in zip(part, totals, values, strict=True):
            row["judge"], row["judges"] = total, value
    summary = {"eval/reward": _mean(r["reward"] for r in rows)}
    summary.update({f"eval/reward/{c.name}": _mean(r["rewards"][c.name] for r in rows) for c in components})
    if judges:
        summary["eval/judge"] = _mean(r["judge"] for r in rows)
        summary.update({f"eval/judge/{c.name}": _mean(r["judges"][c.name] for r in rows) for c in judges})
    # A palette collapse, which neither reward may see (evaluation/diversity.py).
    summary.update({f"eval/{key}": value for key, value in palette(images).items()})
    if all(s is None for s in sources):
        sources = []
    result = RewardEval(summary, rows, images, components, out_dir, sources)
    if out_dir is not None:
        save_eval_grid(result, out_dir / "grid.png")
        if images.dim() == 5:
            save_frame_grid(images, out_dir / "frames.png")
        write_text_atomic(out_dir / "records.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        info = {**summary, "n_images": len(rows), "n_prompts": len(records),
                "config": {"seeds_per_prompt": seeds_per_prompt, "seed": seed, "num_steps": num_steps,
                           "guidance_scale": guidance_scale, "guidance_scale_2": guidance_scale_2,
                           "resolution": resolution, "height": height,
                           "width": width, "num_frames": num_frames, "reward_frames": reward_frames,
                           "negative_prompt": negative_prompt, "sampler": "ode"},
                "components": {c.name: {"spec": c.spec, "weight": c.weight} for c in components}}
        write_text_atomic(out_dir / "report.json", json.dumps(info, indent=2) + "\n")
    return result


def _sample_and_score(family, expanded, seeds, components, *, num_steps, guidance_scale, guidance_scale_2, size,
                      num_frames, negative_prompt, batch_size, out_dir, progress):
    """Batch by batch: sample, score, write each image; the rows, all images and each row's first condition image
    (or None), in order."""
    rows, chunks, firsts = [], [], []
    for start in tqdm(range(0, len(expanded), batch_size), desc="evaluating", disable=not progress,
                      dynamic_ncols=True):
        part = expanded[start : start + batch_size]
        part_seeds = seeds[start : start + batch_size]
        prompts = [r.prompt for _, r in part]
        sources = [[i.read() for i in r.images] for _, r in part]
        images = generate(family, prompts, part_seeds, num_steps=num_steps, guidance_scale=guidance_scale,
                          guidance_scale_2=guidance_scale_2, batch_size=batch_size, **size, num_frames=num_frames,
                          negative_prompt=[negative_prompt_of(r.metadata, negative_prompt) for _, r in part],
                          images=sources if any(sources) else None)
        metadata = [with_condition_images({**r.metadata, "seed": s}, source)
                    for (_, r), s, source in zip(part, part_seeds, sources, strict=True)]
        totals, rewards = score_components(components, images, prompts, metadata)
        firsts += [m[CONDITION_IMAGES_KEY][0] if CONDITION_IMAGES_KEY in m else None for m in metadata]
        for j, ((prompt_index, record), s) in enumerate(zip(part, part_seeds, strict=True)):
            k = start + j
            file = None
            if out_dir is not None:
                file = _write_sample(images[j], out_dir / "images" / f"{k:05d}.png",
                                     fps=family.frame_rate or VIDEO_FPS).relative_to(out_dir).as_posix()
            rows.append({"index": k, "prompt_index": prompt_index, "prompt": record.prompt,
                         "metadata": record.metadata, "seed": s, "reward": totals[j], "rewards": rewards[j],
                         "file": file})
        chunks.append(images)
    return rows, torch.cat(chunks), firsts


def save_eval_grid(result: RewardEval, path: Path, limit: int = GRID_IMAGES) -> Path:
    """The first `limit` images (a video: its first frame), each captioned with its reward and prompt; with
    condition images, each image after its source (source → output, four pairs a row)."""
    shown = result.rows[:limit]
    images = first_frames(result.images[: len(shown)])
    captions = [f"{r['reward']:.3f} {r['prompt']}" for r in shown]
    if result.sources:
        images, captions = with_sources(images, captions, result.sources)
    with atomic_path(path) as tmp:
        save_grid(images, tmp, ncols=GRID_COLUMNS, captions=captions, caption_lines=GRID_CAPTION_LINES)
    return path


def with_sources(images: torch.Tensor, captions: list[str], sources: Sequence[torch.Tensor | None],
                 columns: int = 1) -> tuple[torch.Tensor, list[str]]:
    """Grid cells with each row's source before its `columns` images ([N·columns, 3, H, W], row-major): the source
    fitted to the images' size (a record without one: a grey cell), captioned "source"."""
    height, width = images.shape[-2:]
    cells, texts = [], []
    for k, source in enumerate(sources[: len(images) // columns]):
        cells.append(torch.full((3, height, width), 0.5) if source is None else fit_image(source, height, width))
        texts.append("source" if source is not None else "no source")
        cells += list(images[k * columns : (k + 1) * columns])
        texts += captions[k * columns : (k + 1) * columns]
    return torch.stack(cells), texts


FRAME_GRID_VIDEOS, FRAME_GRID_FRAMES = 8, 8


def save_frame_grid(videos: torch.Tensor, path: Path, limit: int = FRAME_GRID_VIDEOS,
                    frames: int = FRAME_GRID_FRAMES) -> Path:
    """The first `limit` videos [N, 3, F, H, W], one per row, each as up to `frames` evenly spaced frames
    (first and last included), captioned with their frame index: a video's motion at a glance."""
    shown = videos[:limit]
    picks = torch.linspace(0, shown.shape[2] - 1, min(frames, shown.shape[2])).round().long()
    cells = shown.index_select(2, picks).transpose(1, 2).flatten(0, 1)  # [N·K, 3, H, W], row by row
    captions = [f"frame {int(k)}" for _ in range(len(shown)) for k in picks]
    with atomic_path(path) as tmp:
        save_grid(cells, tmp, ncols=len(picks), captions=captions, caption_lines=1)
    return path


def first_frames(images: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] as is; a video batch [N, 3, F, H, W] as its first frames."""
    return images[:, :, 0] if images.dim() == 5 else images


def _write_sample(sample: torch.Tensor, path: Path, fps: float = VIDEO_FPS) -> Path:
    """One image as PNG, or one video [3, F, H, W] as an animated PNG (lossless, unlike a GIF's 256
    colours; every frame, at `fps`, so that it plays as long as the video lasts; viewers without APNG show
    the first frame)."""
    if sample.dim() == 3:
        with atomic_path(path) as tmp:
            Image.fromarray(to_uint8(sample[None])[0]).save(tmp, format="PNG")
        return path
    frames = [Image.fromarray(f) for f in to_uint8(sample.transpose(0, 1))]
    # Pillow folds a frame equal to the one before into it (one frame, summed delay) whenever the two have
    # the same blend op, and offers no switch to turn that off: alternating SOURCE and OVER keeps every
    # frame, and changes no pixel, since an RGB frame has no alpha and OVER of an opaque frame is SOURCE.
    blend = [PngImagePlugin.Blend.OP_SOURCE if i % 2 == 0 else PngImagePlugin.Blend.OP_OVER for i in range(len(frames))]
    with atomic_path(path) as tmp:
        # the delay in ms as a float: Pillow stores it as an exact fraction of a second (1/16 s, not 62 ms)
        frames[0].save(tmp, format="PNG", save_all=True, append_images=frames[1:], duration=1000 / fps, loop=0,
                       disposal=PngImagePlugin.Disposal.OP_NONE, blend=blend)
    return path


def _mean(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else math.nan
