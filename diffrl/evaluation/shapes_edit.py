"""The editing world's held-out evaluation of any image-conditioned model, outside a training run: the
`--world shapes-edit` task's own (`ShapesEditTask.evaluate`: `per_kind` held-out examples of each edit kind, the
test split's instructions in turn with scenes from fixed seeds, ODE at fixed seeds, scored by the strict edit
verifier and its partial credit), so a pretrained editing model's numbers are the ones RL runs log as `eval/strict`.

`python -m diffrl.evaluation.shapes_edit --model-path DIR --guidance-scale 1 3` prints one JSON line per scale
(what scripts/device/pretrain_edit.sh records for each checkpoint); each scale's images, records and grid (every
output after its source) go under `--output-dir/cfg<scale>/rollout-00000/`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

from diffrl.models.base import FamilyAdapter
from diffrl.models.demo import DemoFamily
from diffrl.tasks.base import EvalSettings
from diffrl.tasks.shapes_edit import ShapesEditTask
from diffrl.utils.device import resolve_device


def evaluate_edits(family: FamilyAdapter, out_dir: str | Path, *, per_kind: int = 16, num_steps: int = 10,
                   guidance_scale: float = 3.0, size: int = 64) -> dict[str, float]:
    """The task's evaluation: {"eval/strict", "eval/strict/<kind>", "eval/score"}; files under
    `out_dir/rollout-00000/` (images, records.jsonl, grid.png, report.json)."""
    task = ShapesEditTask(None, SimpleNamespace(eval_images_per_category=per_kind, eval_log_images=0),
                          EvalSettings(num_steps=num_steps, guidance_scale=guidance_scale, resolution=size))
    was_training = family.transformer.training
    family.transformer.eval()
    try:
        return task.evaluate(family, 0, Path(out_dir)).metrics
    finally:
        family.transformer.train(was_training)


def sample_grid(family: FamilyAdapter, path: str | Path, *, per_kind: int = 6, num_steps: int = 10,
                guidance_scale: float = 3.0) -> dict[str, float]:
    """Pretraining's sample grid of an editing model: held-out edits of each kind, each output after its source,
    captioned with the instruction and its strict verdict, at `path`; the evaluation's files beside it (`path`
    without its suffix). Returns the evaluation's metrics."""
    path = Path(path)
    folder = path.with_suffix("")
    metrics = evaluate_edits(family, folder, per_kind=per_kind, num_steps=num_steps, guidance_scale=guidance_scale,
                             size=family.default_size()[0])
    shutil.copyfile(folder / "rollout-00000" / "grid.png", path)
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--guidance-scale", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--per-kind", type=int, default=64, help="held-out examples per edit kind")
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    family = DemoFamily.load(args.model_path, device=resolve_device(args.device))
    for g in args.guidance_scale:
        metrics = evaluate_edits(family, args.output_dir / f"cfg{g:g}", per_kind=args.per_kind,
                                 num_steps=args.num_steps, guidance_scale=g, size=family.default_size()[0])
        print(json.dumps({"model": str(args.model_path), "guidance_scale": g, **metrics}), flush=True)


if __name__ == "__main__":
    main()
