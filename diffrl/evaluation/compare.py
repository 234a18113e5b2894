"""Base versus trained, prompt by prompt: the same prompts and seeds through both models (ODE),
and a win/tie/loss per prompt.

Shapes world: each image scored strictly and by partial credit. A prompt is a win for the trained
model when its strict pass count is higher, or equal with a higher mean partial score; a tie when both
are equal (partial scores within 1e-6); else a loss.

Any reward on a prompt set: see `compare_by_reward` (three columns, a stated tie margin).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from diffrl.evaluation.reward_eval import first_frames, with_sources
from diffrl.evaluation.shapes import SampleRecord, evaluate_prompts, mean_se, record_caption
from diffrl.models.base import FamilyAdapter
from diffrl.utils.atomic import atomic_path
from diffrl.utils.images import save_grid

_TIE_TOLERANCE = 1e-6


@dataclass
class PromptComparison:
    prompt: str
    category: str
    base_strict: int  # passes over the prompt's seeds
    trained_strict: int
    base_score: float  # mean partial credit
    trained_score: float
    outcome: str  # "win" | "tie" | "loss" for the trained model
    n: int = 0  # images (seeds) of the prompt in each model


def outcome(base_strict: int, trained_strict: int, base_score: float, trained_score: float) -> str:
    if trained_strict != base_strict:
        return "win" if trained_strict > base_strict else "loss"
    if abs(trained_score - base_score) <= _TIE_TOLERANCE:
        return "tie"
    return "win" if trained_score > base_score else "loss"


def compare_records(prompts: Sequence[str], base: Sequence[SampleRecord], trained: Sequence[SampleRecord]) -> list[PromptComparison]:
    rows = []
    for prompt in prompts:
        b = [r for r in base if r.prompt == prompt]
        t = [r for r in trained if r.prompt == prompt]
        bs, ts = sum(r.strict for r in b), sum(r.strict for r in t)
        bscore, tscore = sum(r.score for r in b) / len(b), sum(r.score for r in t) / len(t)
        rows.append(PromptComparison(prompt, b[0].category, bs, ts, bscore, tscore, outcome(bs, ts, bscore, tscore),
                                     len(b)))
    return rows


def compare_models(
    base: FamilyAdapter,
    trained: FamilyAdapter,
    prompts: Sequence[str],
    *,
    seed: int = 0,
    num_seeds: int | Sequence[int] = 1,
    num_steps: int = 10,
    base_guidance_scale: float = 1.0,
    trained_guidance_scale: float = 1.0,
    resolution: int | None = None,
    height: int | None = None,
    width: int | None = None,
    progress: bool = False,
) -> tuple[list[PromptComparison], list[SampleRecord], list[SampleRecord], torch.Tensor, torch.Tensor]:
    """Both models on the same (prompt, seed) pairs (one seed count for all prompts, or one per prompt);
    per-prompt comparisons, records and images."""
    size = dict(resolution=resolution, height=height, width=width, progress=progress)
    base_records, base_images = evaluate_prompts(base, prompts, num_seeds=num_seeds, seed=seed, num_steps=num_steps,
                                                 guidance_scale=base_guidance_scale, **size)
    trained_records, trained_images = evaluate_prompts(trained, prompts, num_seeds=num_seeds, seed=seed,
                                                       num_steps=num_steps, guidance_scale=trained_guidance_scale,
                                                       **size)
    return (compare_records(prompts, base_records, trained_records), base_records, trained_records,
            base_images, trained_images)


MEASURABLE_SE = 2.0  # a difference is called only beyond this many standard errors


def verdict(difference: float, se: float, n: int) -> str:
    """"better" or "worse" when the difference is beyond MEASURABLE_SE standard errors (and there are at least two
    pairs to estimate the error from), else "no measurable difference"."""
    if n < 2 or abs(difference) <= MEASURABLE_SE * se:
        return "no measurable difference"
    return "better" if difference > 0 else "worse"


def _paired(base: Sequence[float], trained: Sequence[float]) -> dict:
    b, b_se = mean_se(base)
    t, t_se = mean_se(trained)
    d, d_se = mean_se([y - x for x, y in zip(base, trained, strict=True)])
    return {"n": len(base), "base": b, "base_se": b_se, "trained": t, "trained_se": t_se, "difference": d,
            "difference_se": d_se, "verdict": verdict(d, d_se, len(base))}


def paired_strict(base: Sequence[SampleRecord], trained: Sequence[SampleRecord]) -> dict:
    """Strict accuracy of both models on the same (prompt, seed) images: per sample, per category and the mean
    over categories, each with its count and standard errors (of each model's accuracy and of the paired
    difference trained − base) and a verdict (`verdict`)."""
    for b, t in zip(base, trained, strict=True):
        if (b.prompt, b.seed) != (t.prompt, t.seed):
            raise ValueError("the base and trained records are not of the same images")
    return paired_groups([r.category for r in base], [float(r.strict) for r in base],
                         [float(r.strict) for r in trained])


def paired_groups(groups: Sequence[str], base: Sequence[float], trained: Sequence[float]) -> dict:
    """`paired_strict`'s figures from per-image values of both models on the same images and each image's group
    (the shapes world's category, the editing world's edit kind): per sample, per group (in first-seen order, under
    "categories") and the mean over groups, each with its count, standard errors and verdict."""
    per_category = {}
    for cat in dict.fromkeys(groups):
        pairs = [(b, t) for g, b, t in zip(groups, base, trained, strict=True) if g == cat]
        per_category[cat] = _paired([b for b, _ in pairs], [t for _, t in pairs])
    k = len(per_category)
    mean = {key: sum(c[key] for c in per_category.values()) / k for key in ("base", "trained", "difference")}
    se = {key: sum(c[key] ** 2 for c in per_category.values()) ** 0.5 / k
          for key in ("base_se", "trained_se", "difference_se")}
    category_mean = {"n": k, **mean, **se}
    category_mean["verdict"] = verdict(mean["difference"], se["difference_se"],
                                       min((c["n"] for c in per_category.values()), default=0))
    return {"per_sample": _paired(list(base), list(trained)),
            "categories": per_category, "category_mean": category_mean, "measurable_se": MEASURABLE_SE}


def format_paired(paired: dict, group: str = "category") -> str:
    """The table `diffrl compare` prints: rows per category (`group`: the editing world's edit kind), per sample
    and the mean over groups; n, each model's strict accuracy ± its standard error, the difference ± its standard
    error and the verdict."""
    lines = [f"{'strict accuracy':<16} {'n':>5}  {'base':>13}  {'trained':>13}  {'trained − base':>15}  verdict"]

    def row(label, c):
        return (f"{label:<16} {c['n']:>5}  {c['base']:>6.3f} ± {c['base_se']:.3f}  {c['trained']:>6.3f} ± "
                f"{c['trained_se']:.3f}  {c['difference']:>+7.3f} ± {c['difference_se']:.3f}  {c['verdict']}")

    for cat, c in paired["categories"].items():
        lines.append(row(cat, c))
    lines.append(row("per sample", paired["per_sample"]))
    lines.append(row(f"{group} mean", paired["category_mean"]))
    return "\n".join(lines)


def tally(rows: Sequence[PromptComparison]) -> dict[str, int]:
    counts = Counter(r.outcome for r in rows)
    return {"win": counts["win"], "tie": counts["tie"], "loss": counts["loss"]}


def save_side_by_side(base_records, trained_records, base_images, trained_images, path: str | Path) -> Path:
    """Pairs of cells, base then trained, four pairs per row; each captioned with its prompt, ok or X and why
    (`record_caption`)."""
    cells, captions = [], []
    for b, t, bi, ti in zip(base_records, trained_records, base_images, trained_images, strict=True):
        cells += [bi, ti]
        captions += [record_caption(b, "base"), record_caption(t, "trained")]
    return save_grid(torch.stack(cells), path, ncols=8, captions=captions, caption_lines=5)


def rows_as_dicts(rows: Sequence[PromptComparison]) -> list[dict]:
    return [asdict(r) for r in rows]


# ---------------------------------------------------------------- by any reward (a prompt set)
# Three columns on the same prompts and seeds: the base with CFG, the base without CFG (guidance 1)
# and the trained model. Per prompt, each column's mean reward over the prompt's seeds; the trained
# model wins against a column when its mean is higher by more than the tie margin (absolute, in reward
# units), loses when lower by more, and ties otherwise.

REWARD_COLUMNS = ("base_cfg", "base_nocfg", "trained")


def reward_outcome(base: float, trained: float, tie_margin: float) -> str:
    """"win" | "tie" | "loss" for the trained model: a tie when |trained − base| ≤ tie_margin."""
    if abs(trained - base) <= tie_margin:
        return "tie"
    return "win" if trained > base else "loss"


def compare_by_reward(columns: dict[str, list[dict]], tie_margin: float) -> tuple[list[dict], dict]:
    """Per-prompt rows and totals from each column's per-prompt means (`RewardEval.per_prompt()`, the
    same prompts in the same order in every column)."""
    if tie_margin < 0:
        raise ValueError(f"--tie-margin must be >= 0, got {tie_margin}")
    base_cfg, base_nocfg, trained = (columns[c] for c in REWARD_COLUMNS)
    rows = []
    for b, n, t in zip(base_cfg, base_nocfg, trained, strict=True):
        rows.append({"prompt_index": t["prompt_index"], "prompt": t["prompt"], "n": t["n"],
                     "base_cfg": b["reward"], "base_nocfg": n["reward"], "trained": t["reward"],
                     "components": {c: {"base_cfg": b["rewards"][c], "base_nocfg": n["rewards"][c], "trained": v}
                                    for c, v in t["rewards"].items()},
                     "vs_base_cfg": reward_outcome(b["reward"], t["reward"], tie_margin),
                     "vs_base_nocfg": reward_outcome(n["reward"], t["reward"], tie_margin)})
    totals = {
        "tie_margin": tie_margin,
        "prompts": len(rows),
        "mean_reward": {c: sum(r[c] for r in rows) / len(rows) for c in REWARD_COLUMNS},
        "vs_base_cfg": _tally_outcomes(r["vs_base_cfg"] for r in rows),
        "vs_base_nocfg": _tally_outcomes(r["vs_base_nocfg"] for r in rows),
        # Per-prompt means paired across columns: each difference with its standard error and a verdict.
        "difference": {key: _paired([r[column] for r in rows], [r["trained"] for r in rows])
                       for key, column in (("vs_base_cfg", "base_cfg"), ("vs_base_nocfg", "base_nocfg"))},
    }
    return rows, totals


def _tally_outcomes(outcomes) -> dict[str, int]:
    counts = Counter(outcomes)
    return {"win": counts["win"], "tie": counts["tie"], "loss": counts["loss"]}


def reward_markdown(rows: Sequence[dict], totals: dict, labels: dict[str, str]) -> str:
    """compare.md: one table row per prompt (mean reward over its seeds), then the totals."""
    head = [labels[c] for c in REWARD_COLUMNS]
    lines = ["| # | prompt | " + " | ".join(head) + " | vs base CFG | vs base no CFG |",
             "|---:|---|" + "---:|" * len(head) + "---|---|"]
    for r in rows:
        prompt = r["prompt"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['prompt_index']} | {prompt} | " + " | ".join(f"{r[c]:.4f}" for c in REWARD_COLUMNS)
                     + f" | {r['vs_base_cfg']} | {r['vs_base_nocfg']} |")
    mean = totals["mean_reward"]
    lines.append("| | **mean** | " + " | ".join(f"**{mean[c]:.4f}**" for c in REWARD_COLUMNS) + " | | |")
    lines.append("")
    for key, label in (("vs_base_cfg", labels["base_cfg"]), ("vs_base_nocfg", labels["base_nocfg"])):
        t = totals[key]
        lines.append(f"- trained vs {label}: {t['win']} wins, {t['tie']} ties, {t['loss']} losses "
                     f"over {totals['prompts']} prompts")
    lines.append(f"- tie margin: |trained − base| ≤ {totals['tie_margin']} (mean reward over a prompt's seeds)")
    for key, label in (("vs_base_cfg", labels["base_cfg"]), ("vs_base_nocfg", labels["base_nocfg"])):
        d = totals.get("difference", {}).get(key)
        if d is not None:
            lines.append(f"- trained − {label}: {d['difference']:+.4f} ± {d['difference_se']:.4f} (standard error over "
                         f"{d['n']} prompts): **{d['verdict']}** (called beyond {MEASURABLE_SE:g} standard errors)")
    return "\n".join(lines) + "\n"


def save_reward_side_by_side(evals: dict, labels: dict[str, str], path: str | Path, limit: int = 32) -> Path:
    """Rows = images (prompt, seed) in order, columns = base CFG / base no CFG / trained, each cell
    captioned with its column, reward and prompt; the first `limit` rows. Where the records have condition images,
    each row starts with its source."""
    n = min(limit, len(evals["trained"].rows))
    cells, captions = [], []
    for k in range(n):
        for c in REWARD_COLUMNS:
            row = evals[c].rows[k]
            cells.append(first_frames(evals[c].images[k : k + 1])[0])
            captions.append(f"{labels[c]} {row['reward']:.3f} | {row['prompt']}")
    images, columns = torch.stack(cells), len(REWARD_COLUMNS)
    if evals["trained"].sources:
        images, captions = with_sources(images, captions, evals["trained"].sources, columns)
        columns += 1
    with atomic_path(Path(path)) as tmp:
        save_grid(images, tmp, ncols=columns, captions=captions, caption_lines=3)
    return Path(path)
