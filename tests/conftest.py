"""Shared fixtures: tiny random demo models built in code (no downloads)."""

import pytest
import torch

from diffrl.models.demo import DemoFamily
from diffrl.models.random_checkpoints import demo as random_demo


@pytest.fixture
def tiny_family() -> DemoFamily:
    torch.manual_seed(0)
    return random_demo.random_family(random_demo.tiny(), seed=0)


@pytest.fixture
def tiny_model_dir(tmp_path, tiny_family):
    path = tmp_path / "tiny-demo"
    tiny_family.save(path)
    return path


@pytest.fixture(scope="module")
def module_tiny_model_dir(tmp_path_factory):
    """The same tiny model as `tiny_model_dir`, saved once for a module's tests (for module-scoped runs of it)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("module-model") / "tiny-demo"
    random_demo.random_family(random_demo.tiny(), seed=0).save(path)
    return path


@pytest.fixture(scope="module")
def restorable_runs(tmp_path_factory):
    """Run folders trained once per module and handed to each test as a fresh copy at the same path
    (a run's config.json names its own folder): `restorable_runs(name, train)` trains on first use."""
    import shutil

    root = tmp_path_factory.mktemp("runs")

    def fresh(name, train):
        run, pristine = root / name, root / f".{name}-pristine"
        if not pristine.exists():
            train(run)
            shutil.copytree(run, pristine)
        else:
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(pristine, run)
        return run

    return fresh


@pytest.fixture
def wan_i2v_prompt_clean(monkeypatch):
    """WanImageToVideoPipeline's prompt cleaning calls ftfy unguarded (WanPipeline's, which ours is, skips it when
    ftfy is not installed, as here): the same cleaning for ASCII prompts (`pytest.mark.usefixtures` it)."""
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)
