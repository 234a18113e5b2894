"""Tasks: where a run's prompts come from and how its model is judged (docs/architecture.md, "Data flow").

The trainer asks its task for each rollout's prompts (`draw`), tells it the rewards they earned
(`observe`), and asks it to evaluate the engine's model (`evaluate`); it knows nothing else about
them. `shapes` is the zero-configuration demo world (exact verifier, GenEval categories);
`shapes_edit` is its editing world (`--world shapes-edit`); `prompt_set` is a user's prompt dataset judged by any
reward on its held-out split.
"""

from __future__ import annotations

from diffrl.tasks.base import EvalOutcome, EvalSettings, Task
from diffrl.tasks.prompt_set import PromptSetTask
from diffrl.tasks.shapes import ShapesTask
from diffrl.tasks.shapes_edit import ShapesEditTask

__all__ = ["EvalOutcome", "EvalSettings", "Task", "build_task"]


def build_task(cfg) -> Task:
    """The task a `TrainConfig` asks for: a prompt dataset with `--prompt-data`, else the shapes world."""
    settings = EvalSettings.from_config(cfg)
    if cfg.task.prompt_data is not None:
        return PromptSetTask(cfg.task, cfg.eval, settings, seed=cfg.seed)
    if cfg.task.world == "shapes-edit":
        return ShapesEditTask(cfg.task, cfg.eval, settings, seed=cfg.seed)
    # Here, not in the config's check: an image-to-video recipe that sets it is checked alone, without --prompt-data.
    if cfg.task.condition_images == "required":
        raise ValueError("--condition-images required checks the rows of --prompt-data; the shapes world's prompts are "
                         "text only (pass --prompt-data FILE.jsonl whose rows name their condition images)")
    return ShapesTask(cfg.task, cfg.eval, settings, seed=cfg.seed)
