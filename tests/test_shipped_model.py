"""The demo model shipped in the repository loads offline and draws recognisable shapes."""

import os

from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.data.shapes import verify
from diffrl.evaluation.shapes import generate
from diffrl.models import resolve_family
from diffrl.utils.images import to_uint8


def test_shipped_model_loads_offline_and_draws_easy_prompts(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("DIFFRL_MODEL_FAMILY", raising=False)
    family = resolve_family(None, SHIPPED_DEMO_MODEL).load(SHIPPED_DEMO_MODEL)
    assert os.path.basename(SHIPPED_DEMO_MODEL) == "demo-shapes"
    prompts = ["a red circle"] * 2 + ["a blue square"] * 2 + ["a yellow triangle"] * 2
    images = generate(family, prompts, seeds=list(range(6)), num_steps=10, guidance_scale=3.0)
    verdicts = [verify(img, p) for img, p in zip(to_uint8(images), prompts)]
    # A random-weight model scores 0 here; the shipped one must get most of these single colored shapes.
    assert sum(v.strict for v in verdicts) >= 4, [v.reason for v in verdicts]
