"""--use-wandb: every metrics record and evaluation image go to Weights & Biases too (a stand-in `wandb`
module records the calls: the real one needs an account), and a resumed run continues the same W&B run."""

import json
import sys
import types

import pytest

from diffrl.train.trainer import Trainer
from test_trainer import tiny_config


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0
        wandb = self

        class Run:
            def log(self, data, step):
                wandb.logged.append((step, data))

            def finish(self):
                wandb.finished += 1

        class Image:
            def __init__(self, pixels, caption=None):
                self.shape, self.caption = pixels.shape, caption

        self.Run, self.Image = Run, Image

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self.Run()


def test_records_and_images_reach_wandb_and_resume_continues_its_run(tiny_model_dir, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    # One held-out image per category (not 8) is enough for evaluation records and images to reach wandb.
    flags = dict(use_wandb=True, wandb_project="p", wandb_group="g", wandb_mode="offline", eval_images_per_category=1)
    Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, **flags)).train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scalars = [(step, data) for step, data in fake.logged if "rollout/reward/raw_mean" in data or "eval/strict" in data]
    assert [(step, data) for step, data in scalars] == [(r["rollout"], {k: v for k, v in r.items() if k != "rollout"})
                                                        for r in records]
    images = [data for _, data in fake.logged if any(isinstance(v, list) for v in data.values())]
    assert images and all(img.shape[-1] == 3 and img.caption for data in images for v in data.values() for img in v)
    first = fake.inits[0]
    assert (first["project"], first["group"], first["name"], first["mode"]) == ("p", "g", "run", "offline")
    assert first["config"]["lr"] == 1e-3 and first["dir"] == str(out) and fake.finished == 1
    Trainer(tiny_config(tiny_model_dir, out, num_rollout=3, resume=True, **flags)).train()
    assert fake.inits[1]["id"] == first["id"] == (out / "wandb_id").read_text().strip()
    assert fake.inits[1]["resume"] == "allow" and fake.logged[-1][0] == 3


def test_use_wandb_without_the_package_is_refused_before_loading(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Refused as every bad setting is: 'error: …' and exit status 2 (it was a bare SystemExit message, status 1)."""
    from diffrl.cli.main import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match="wandb package is not installed"):
        Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_wandb=True))
    assert not (tmp_path / "run").exists()
    capsys.readouterr()
    assert main(["train", "--model-path", str(tiny_model_dir), "--device", "cpu", "--use-wandb",
                 "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == "error: --use-wandb: the wandb package is not installed (pip install wandb)"
