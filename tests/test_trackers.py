"""--use-wandb and --use-swanlab: every metrics record and evaluation image go to Weights & Biases or SwanLab too (a
stand-in module records the calls: the real ones need an account), and a resumed run continues the same tracked run.
The stand-in takes the keywords the packages' `init` declares (wandb; swanlab 0.10: `log_dir`, not `dir`)."""

import json
import sys
import types

import pytest

from diffrl.train.trainer import Trainer
from test_trainer import tiny_config


class FakeTracker(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
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


@pytest.mark.parametrize(("name", "local"), [("wandb", ("dir", "")), ("swanlab", ("log_dir", "swanlog"))])
def test_records_and_images_reach_the_tracker_and_resume_continues_its_run(name, local, tiny_model_dir, tmp_path,
                                                                           monkeypatch):
    fake = FakeTracker(name)
    monkeypatch.setitem(sys.modules, name, fake)
    out = tmp_path / "run"
    # One held-out image per category (not 8) is enough for evaluation records and images to reach the tracker.
    flags = {f"use_{name}": True, f"{name}_project": "p", f"{name}_group": "g", f"{name}_mode": "offline",
             "eval_images_per_category": 1}
    Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, **flags)).train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scalars = [(step, data) for step, data in fake.logged if "rollout/reward/raw_mean" in data or "eval/strict" in data]
    assert [(step, data) for step, data in scalars] == [(r["rollout"], {k: v for k, v in r.items() if k != "rollout"})
                                                        for r in records]
    images = [data for _, data in fake.logged if any(isinstance(v, list) for v in data.values())]
    assert images and all(img.shape[-1] == 3 and img.caption for data in images for v in data.values() for img in v)
    first = fake.inits[0]
    assert (first["project"], first["group"], first["name"], first["mode"]) == ("p", "g", "run", "offline")
    keyword, subdir = local
    assert first["config"]["lr"] == 1e-3 and first[keyword] == str(out / subdir if subdir else out)
    assert fake.finished == 1
    Trainer(tiny_config(tiny_model_dir, out, num_rollout=3, resume=True, **flags)).train()
    assert fake.inits[1]["id"] == first["id"] == (out / f"{name}_id").read_text().strip()
    assert fake.inits[1]["resume"] == "allow" and fake.logged[-1][0] == 3


def test_both_trackers_at_once_each_get_every_record(tiny_model_dir, tmp_path, monkeypatch):
    fakes = {name: FakeTracker(name) for name in ("wandb", "swanlab")}
    for name, fake in fakes.items():
        monkeypatch.setitem(sys.modules, name, fake)
    Trainer(tiny_config(tiny_model_dir, tmp_path / "run", num_rollout=1, use_wandb=True, use_swanlab=True,
                        swanlab_mode="disabled")).train()
    def scalars(fake):
        return [(step, {k: v for k, v in data.items() if not isinstance(v, list)}) for step, data in fake.logged]

    assert fakes["wandb"].logged and scalars(fakes["wandb"]) == scalars(fakes["swanlab"])
    assert len(fakes["wandb"].logged) == len(fakes["swanlab"].logged)  # the images too
    assert fakes["swanlab"].inits[0]["mode"] == "disabled" and fakes["wandb"].inits[0]["mode"] == "online"


@pytest.mark.parametrize("name", ["wandb", "swanlab"])
def test_a_tracker_without_its_package_is_refused_before_loading(name, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Refused as every bad setting is: 'error: …' and exit status 2 (it was a bare SystemExit message, status 1)."""
    from diffrl.cli.main import main

    monkeypatch.setitem(sys.modules, name, None)  # the import raises ImportError
    with pytest.raises(ValueError, match=f"{name} package is not installed"):
        Trainer(tiny_config(tiny_model_dir, tmp_path / "run", **{f"use_{name}": True}))
    assert not (tmp_path / "run").exists()
    capsys.readouterr()
    assert main(["train", "--model-path", str(tiny_model_dir), "--device", "cpu", f"--use-{name}",
                 "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --use-{name}: the {name} package is not installed "
                                               f"(pip install {name})")
