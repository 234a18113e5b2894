"""The shapes world as a task: GenEval-style prompts by category, judged by the exact verifier.

Training prompts come from the train split through `CategorySampler` (categories in turn, or
adaptively by training reward); evaluation scores the test split (`eval/strict`, per category) and,
with `--val-images-per-category`, a fixed subset of the train prompts (`val/strict`), which picks
`checkpoints/best` without looking at the test prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

from diffrl.data.prompts import PromptRecord
from diffrl.data.shapes import prompts_by_category, test_prompts
from diffrl.evaluation.shapes import (
    TEST_SEED,
    VALIDATION_SEED,
    balanced_eval_set,
    evaluate_prompts,
    save_records_grid,
    summarize,
    validation_prompts,
)
from diffrl.tasks.base import EvalOutcome, EvalSettings
from diffrl.tasks.prompt_sampler import CategorySampler


class ShapesTask:
    name = "shapes"

    def __init__(self, task_cfg, eval_cfg, settings: EvalSettings, seed: int = 0):
        by_category = prompts_by_category("train")
        unknown = sorted(set(task_cfg.train_categories) - set(by_category))
        if unknown:
            raise ValueError(f"--train-categories: unknown {unknown}; known: {', '.join(by_category)}")
        self.sampler = CategorySampler({c: by_category[c] for c in (task_cfg.train_categories or by_category)},
                                       mode=task_cfg.category_sampling, floor=task_cfg.category_sampling_floor,
                                       smoothing=task_cfg.category_reward_smoothing, seed=seed,
                                       difficulty=task_cfg.category_difficulty,
                                       solved_reward=task_cfg.category_solved_reward)
        self.adaptive = task_cfg.category_sampling == "adaptive"
        self.eval_cfg, self.settings = eval_cfg, settings
        self.selection_metric = "val/strict" if eval_cfg.val_images_per_category > 0 else None
        self.evaluates = bool(eval_cfg.eval_images_per_category or eval_cfg.val_images_per_category)
        self._shares: dict[str, float] = {}

    def check_family(self, family) -> None:
        if family.generates_video and self.evaluates:
            raise ValueError(f"the {family.name} family generates video and the held-out shapes evaluation scores "
                             "images: pass --eval-images-per-category 0 (and --val-images-per-category 0)")

    def draw(self, k: int, batch: int) -> list[PromptRecord]:
        self._shares = self.sampler.weights()  # before this rollout's rewards update them
        prompts, categories = self.sampler.draw(k, batch)
        return [PromptRecord(p, {"category": c}) for p, c in zip(prompts, categories, strict=True)]

    def observe(self, prompts: Sequence[PromptRecord], group_rewards) -> dict[str, float]:
        means = self.sampler.observe([p.metadata["category"] for p in prompts], group_rewards)
        metrics = {f"rollout/reward/{c}": m for c, m in means.items()}
        if self.adaptive:
            metrics.update({f"rollout/category_share/{c}": w for c, w in self._shares.items()})
            metrics.update({f"rollout/unsolved/{c}": u for c, u in self.sampler.unsolved.items()})
        return metrics

    def evaluate(self, family, k: int, out_dir) -> EvalOutcome:
        e, s = self.eval_cfg, self.settings
        sets = [("eval", test_prompts(), e.eval_images_per_category, TEST_SEED)] if e.eval_images_per_category else []
        if e.val_images_per_category > 0:
            sets.append(("val", validation_prompts(e.val_prompts_per_category), e.val_images_per_category,
                         VALIDATION_SEED))
        outcome = EvalOutcome()
        for prefix, prompts, per_category, seed in sets:
            prompts, seeds_per_prompt = balanced_eval_set(prompts, per_category)
            records, images = evaluate_prompts(family, prompts, num_seeds=seeds_per_prompt, seed=seed,
                                               num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                                               **s.size(), negative_prompt=s.negative_prompt)
            summary = summarize(records)
            outcome.metrics[f"{prefix}/strict"] = summary["overall_strict"]
            outcome.metrics[f"{prefix}/score"] = summary["overall_score"]
            outcome.metrics[f"{prefix}/background_delta_e"] = summary["background_delta_e"]
            for cat, c in summary["categories"].items():
                outcome.metrics[f"{prefix}/strict/{cat}"] = c["strict"]
            if prefix == "eval":
                save_records_grid(records, images, out_dir / f"rollout-{k:05d}.png", limit=32)
                shown = min(self.eval_cfg.eval_log_images, len(records))
                outcome.images = images[:shown]
                outcome.captions = [("ok " if r.strict else "X ") + r.prompt for r in records[:shown]]
        return outcome

    def state_dict(self) -> dict:
        return {"category_sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state.get("category_sampler", {}))
