"""A run's one-page report, `report.md` in its folder: what ran (the settings a reader asks for first), how
it went (the reward's first and last rollouts, every held-out evaluation), what it cost (seconds, images/s,
train pairs/s, memory) and where the rest is (curve, evaluation images, checkpoints).

Written from `config.json`'s flat settings and `metrics.jsonl` alone, atomically, at every checkpoint and at
the end of the run, so a killed run has the report of its last checkpoint and `write_report(run_dir)`
rebuilds it for any run folder.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from diffrl.train.metrics import best_by_selection, read_metrics
from diffrl.utils.atomic import write_text_atomic

# The settings a reader checks first, by flat name (config.json "flags"), in this order.
_SETTINGS = (
    ("recipe", "recipe"), ("diffusion_model_family", "family"), ("model_path", "model"),
    ("loss_type", "algorithm"), ("reward", "reward"), ("prompt_data", "prompt data"),
    ("eval_prompt_data", "held-out prompt data"), ("resolution", "resolution"), ("height", "height"),
    ("width", "width"), ("num_frames", "frames per video"), ("reward_frames", "frames the reward sees"),
    ("diffusion_num_steps", "denoising steps"), ("diffusion_guidance_scale", "CFG scale"),
    ("diffusion_guidance_scale_2", "low-noise expert's CFG scale"),
    ("diffusion_sde_type", "SDE type"), ("diffusion_noise_level", "noise level"),
    ("diffusion_sde_window_range", "SDE window"), ("diffusion_num_sde_steps", "SDE steps per sample"),
    ("rollout_batch_size", "prompt groups per rollout"), ("n_samples_per_prompt", "samples per prompt"),
    ("rollout_microgroup_size", "microgroup"), ("global_batch_size", "samples per optimizer step"),
    ("num_steps_per_rollout", "optimizer steps per rollout"), ("use_lora", "LoRA"), ("lora_rank", "LoRA rank"),
    ("lr", "learning rate"), ("lr_schedule", "learning-rate schedule"), ("diffusion_clip_range", "clip range"),
    ("diffusion_kl_beta", "KL β"), ("num_rollout", "rollouts planned"), ("seed", "seed"),
    ("deterministic_mode", "deterministic mode"), ("device", "device"), ("mixed_precision", "precision"),
)
# Per-rollout costs: metric, label, format.
_COSTS = (
    ("rollout/seconds", "rollout seconds", "{:.2f}"), ("rollout/images_per_s", "images/s", "{:.2f}"),
    ("train/seconds", "training seconds", "{:.2f}"), ("train/pairs_per_s", "train pairs/s", "{:.1f}"),
    ("memory/peak_gib", "peak GPU memory (GiB)", "{:.1f}"),
)


# Held-out columns shown first in the report's table, in this order; the rest follow by name.
_HEADLINE_EVAL_KEYS = ("eval/strict", "eval/score", "eval/reward", "eval/judge", "eval/hacking_gap_sd", "eval/hue_spread")


def write_report(run_dir: Path) -> Path:
    """(Re)write `run_dir/report.md` from the run's config.json and metrics.jsonl; returns its path."""
    run_dir = Path(run_dir)
    flags = {}
    if (run_dir / "config.json").is_file():
        flags = json.loads((run_dir / "config.json").read_text()).get("flags", {})
    records, _ = read_metrics(run_dir / "metrics.jsonl")
    path = run_dir / "report.md"
    write_text_atomic(path, render_report(run_dir, flags, records))
    return path


def render_report(run_dir: Path, flags: dict, records: list[dict]) -> str:
    rollouts = [r for r in records if "rollout/reward/raw_mean" in r]
    lines = [f"# Run report: {run_dir.name}", ""]
    done = rollouts[-1]["rollout"] if rollouts else 0
    elapsed = rollouts[-1].get("time/elapsed_s") if rollouts else None
    lines.append(f"{done} of {flags.get('num_rollout', '?')} rollouts"
                 + (f" in {_duration(elapsed)} of rollout and training" if elapsed is not None else "")
                 + " (evaluations and checkpoints not counted).")
    lines += ["", "## Settings", "", "| setting | value |", "|---|---|"]
    for key, label in _SETTINGS:
        value = flags.get(key)
        if value is None or (key == "lora_rank" and not flags.get("use_lora")):
            continue
        lines.append(f"| {label} (`--{key.replace('_', '-')}`) | {_cell(value)} |")
    lines.append("")
    lines.append("Every setting: `config.json`.")

    lines += ["", "## Outcome", ""]
    summary = run_summary(records)
    lines += ([] if rollouts else ["- no rollout finished yet"]) + [f"- {line}" for line in summary.splitlines()]
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    if evals:
        found = {k for r in evals for k in r if k.startswith("eval/") and isinstance(r[k], int | float)}
        headline = [k for k in _HEADLINE_EVAL_KEYS if k in found]
        keys = headline + sorted(found.difference(headline))
        lines += ["", "Held-out evaluations (ODE, fixed seeds):", "",
                  "| rollout | " + " | ".join(f"`{k}`" for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for r in evals:
            lines.append(f"| {r['rollout']} | " + " | ".join(_number(r.get(k)) for k in keys) + " |")
        lines.append("")  # a line right under a table would render as one more of its rows
    gaps = [r for r in records if "eval/hacking_gap_sd" in r]
    if gaps:
        last = gaps[-1]
        lines.append(f"since the first evaluation, in units of its spread: reward {last['eval/reward_gain_sd']:+.2f}, "
                     f"judge {last['eval/judge_gain_sd']:+.2f}, gap {last['eval/hacking_gap_sd']:+.2f} (a gap well "
                     "above 0: the reward rose where the judge did not)")
    hues = [r["eval/hue_spread"] for r in records if "eval/hue_spread" in r]
    if len(hues) >= 2 and hues[-1] < 0.5 * hues[0]:  # evaluation/diversity.py
        lines.append(f"the held-out images' hues narrowed: `eval/hue_spread` {hues[0]:.2f} → {hues[-1]:.2f} (one "
                     "palette no reward asked for; look at the grids)")
    best = best_by_selection(records, "val/strict")
    if best is not None:
        lines += ["", f"`checkpoints/best` holds rollout {best['rollout']} (highest validation accuracy)."]

    if rollouts:
        lines += ["", "## Cost", ""] + _cost_lines(rollouts)

    lines += ["", "## Files", ""]
    if (run_dir / "reward_curve.png").is_file():
        lines += ["![reward and held-out scores by rollout](reward_curve.png)", ""]
    lines.append("- `metrics.jsonl` (one record per rollout), `tensorboard/`, `config.json`")
    eval_dir = run_dir / "eval"
    if eval_dir.is_dir() and (entries := sorted(p.name for p in eval_dir.iterdir())):
        shown = entries if len(entries) <= 6 else [*entries[:3], "…", *entries[-2:]]
        lines.append(f"- `eval/`: {', '.join(e if e == '…' else f'`{e}`' for e in shown)}")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and (saved := sorted(p.name for p in checkpoints.iterdir() if p.is_dir())):
        lines.append(f"- `checkpoints/`: {', '.join(f'`{name}`' for name in saved)}")
    return "\n".join(lines) + "\n"


def _cost_lines(rollouts: list[dict]) -> list[str]:
    """Per-rollout costs: the median of the rollouts after the first, which pays the warm-up (allocator, kernels,
    compilation); a run of one rollout shows that rollout's, warm-up included."""
    first = rollouts[0]["rollout"]
    steady = rollouts[1:]
    if not steady:
        head, column = f"Rollout {first}, the run's only one (its warm-up included):", "value"
    elif len(steady) == 1:
        head, column = f"Rollout {steady[0]['rollout']} (rollout {first} holds the warm-up and is left out):", "value"
    else:
        head, column = (f"Medians of rollouts {steady[0]['rollout']}–{steady[-1]['rollout']} (rollout {first} holds "
                        "the warm-up and is left out):"), "median"
    lines = [head, "", f"| per rollout | {column} |", "|---|---|"]
    for key, label, fmt in _COSTS:
        values = [r[key] for r in (steady or rollouts) if isinstance(r.get(key), int | float)]
        if values:
            lines.append(f"| {label} | {fmt.format(statistics.median(values))} |")
    return lines


def _cell(value) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return f"`{value}`" if isinstance(value, str) else str(value)


def _number(value) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def run_summary(records: list[dict], window: int = 4) -> str:
    """First vs last rollouts' mean reward (± standard error) and held-out scores before/after."""
    rewards = [r["rollout/reward/raw_mean"] for r in records if "rollout/reward/raw_mean" in r]
    lines = []
    rollouts = [r["rollout"] for r in records if "rollout/reward/raw_mean" in r]
    if len(rewards) == 1:  # too few for first vs last: the one rollout's reward
        lines.append(f"reward: rollout {rollouts[0]} {rewards[0]:.3f}")
    if 2 <= len(rewards) < 4:  # windows of one rollout have no standard error
        lines.append(f"reward: rollout {rollouts[0]} {rewards[0]:.3f} → rollout {rollouts[-1]} {rewards[-1]:.3f}")
    if len(rewards) >= 4:
        w = max(1, min(window, len(rewards) // 2))

        def mean_se(xs):
            m = sum(xs) / len(xs)
            var = sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)
            return m, (var / len(xs)) ** 0.5

        (m0, s0), (m1, s1) = mean_se(rewards[:w]), mean_se(rewards[-w:])
        lines.append(f"reward: first {w} rollouts {m0:.3f} ± {s0:.3f} → last {w} rollouts {m1:.3f} ± {s1:.3f}")
    if len(rewards) >= 3:
        slope, se = reward_trend(rewards)
        lines.append(f"reward trend: {slope:+.4f} ± {se:.4f} per rollout (least squares over {len(rewards)} rollouts)")
    for key, label in (("eval/strict", "held-out strict accuracy"), ("eval/reward", "held-out reward"),
                       ("eval/judge", "held-out judge (--eval-reward)")):
        evals = [(r["rollout"], r[key]) for r in records if key in r]
        if len(evals) >= 2:
            lines.append(f"{label}: rollout {evals[0][0]} {evals[0][1]:.3f} → rollout {evals[-1][0]} {evals[-1][1]:.3f}")
        elif evals:
            lines.append(f"{label}: rollout {evals[0][0]} {evals[0][1]:.3f}")
    best = best_by_selection(records, "val/strict")
    if best is not None:
        lines.append(f"checkpoints/best (highest validation accuracy on train prompts): rollout {best['rollout']}, "
                     f"validation {best['val/strict']:.3f}, held-out {best.get('eval/strict', float('nan')):.3f}")
    return "\n".join(lines)


def reward_trend(rewards: list[float]) -> tuple[float, float]:
    """Least-squares slope of reward against rollout index and its standard error: a rise is
    "beyond noise" when the slope is several standard errors above 0."""
    x = np.arange(len(rewards), dtype=np.float64)
    y = np.asarray(rewards, dtype=np.float64)
    xc = x - x.mean()
    slope = float(xc @ (y - y.mean()) / (xc @ xc))
    residuals = y - y.mean() - slope * xc
    se = float(np.sqrt(residuals @ residuals / (len(y) - 2) / (xc @ xc)))
    return slope, se
