"""The editing world as a task (`--world shapes-edit`): each prompt is an edit instruction with its rendered source
scene as the condition image, judged by `verify_edit` against that source (docs/editing-world.md).

Training draws examples of the train split (`sample_example`: kind, instruction and scene from a seed fixed by the
run's seed, the rollout and the prompt's place in it), so a rollout's prompts are the same on any rerun and need no
state. The reward is the run's `--reward` (`shapes_edit`: partial credit; `shapes_edit_strict`). Evaluation samples
`--eval-images-per-category` held-out examples of each edit kind (the test split's instructions in turn, scenes from
fixed seeds) and scores them strictly: `eval/strict`, `eval/strict/<kind>`, and the partial credit `eval/score`;
its grid shows each source before its output.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from diffrl.data.prompts import PromptRecord
from diffrl.data.shapes import sample_example
from diffrl.evaluation.shapes_edit import DEFAULT_SIZE, edit_record, evaluate_held_out
from diffrl.tasks.base import EvalOutcome, EvalSettings

class ShapesEditTask:
    name = "shapes_edit"

    def __init__(self, task_cfg, eval_cfg, settings: EvalSettings, seed: int = 0):
        height, width = settings.height or settings.resolution, settings.width or settings.resolution
        if height != width:
            raise ValueError(f"--world shapes-edit renders square scenes; got {width}x{height} (pass --resolution)")
        self.size = height or DEFAULT_SIZE
        self.seed, self.eval_cfg, self.settings = seed, eval_cfg, settings
        self.selection_metric = None
        self.evaluates = eval_cfg.eval_images_per_category > 0

    def check_family(self, family) -> None:
        if not family.accepts_image_conditioning:
            raise ValueError(f"--world shapes-edit gives every prompt a source image; the {family.name} family at this "
                             "checkpoint takes none (use an image-conditioned one, e.g. FLUX.1 Kontext)")

    def draw(self, k: int, batch: int) -> list[PromptRecord]:
        seeds = [self.seed * 1_000_000_007 + k * batch + i for i in range(batch)]
        return [edit_record(sample_example(s, "train", size=self.size), f"shapes-edit train seed {s}") for s in seeds]

    def observe(self, prompts: Sequence[PromptRecord], group_rewards) -> dict[str, float]:
        by_kind: dict[str, list[float]] = defaultdict(list)
        for record, rewards in zip(prompts, group_rewards, strict=True):
            by_kind[record.metadata["edit_kind"]].extend(float(r) for r in rewards)
        return {f"rollout/reward/{kind}": float(np.mean(values)) for kind, values in by_kind.items()}

    def evaluate(self, family, k: int, out_dir) -> EvalOutcome:
        s = self.settings
        metrics, result = evaluate_held_out(family, self.eval_cfg.eval_images_per_category, self.size,
                                            num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                                            negative_prompt=s.negative_prompt, out_dir=out_dir / f"rollout-{k:05d}")
        rows = result.rows
        shown = min(self.eval_cfg.eval_log_images, len(rows))
        return EvalOutcome(metrics=metrics, images=result.images[:shown],
                           captions=[("ok " if r["rewards"]["strict"] else "X ") + r["prompt"] for r in rows[:shown]])

    def state_dict(self) -> dict:
        return {}  # each rollout's prompts follow from the run's seed and the rollout's index

    def load_state_dict(self, state: dict) -> None:
        pass
