"""A checkpoint of another family is refused in one line that reads in order: what the checkpoint is, what the run's
family loads, what to pass instead (a recipe of the checkpoint's family, or the flag). It read "…/transformer holds
Flux3Transformer2DModel, a checkpoint of the family demo or flux3_image; SD3 loads SD3Transformer2DModel: for this
checkpoint pass --diffusion-model-family demo or flux3_image (and a recipe of that family)"."""

import shutil

import pytest

from diffrl.cli.main import main
from diffrl.errors import ModelLoadError
from diffrl.models import get_family, resolve_family
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.models.random_checkpoints.flux3_image import save_random_checkpoint


@pytest.fixture(scope="module")
def flux3_dir(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "my-model")


def test_another_familys_checkpoint_is_named_first_then_the_fix(flux3_dir, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text('a sign that says "OPEN"\n')
    assert main(["train", "--recipe", "sd35-grpo-ocr", "--model-path", str(flux3_dir), "--prompt-data",
                 str(tmp_path / "prompts.txt"), "--device", "cpu", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {flux3_dir} is a checkpoint of the flux3_image family (transformer/ holds "
                   "Flux3Transformer2DModel), not of SD3 (which loads SD3Transformer2DModel): pass a recipe of the "
                   "flux3_image family (flux3-klein-nft-pickscore, flux3-klein-edit-nft-pickscore, flux3-klein-grpo-hps) "
                   "or --diffusion-model-family "
                   "flux3_image")


def test_a_shared_transformer_class_is_told_apart_by_the_rest_of_the_checkpoint(flux3_dir, tmp_path, monkeypatch):
    """The demo model and FLUX 3 share Flux3Transformer2DModel: a FLUX 3 checkpoint (VAE, Qwen3-VL) under a name that
    says nothing is FLUX 3's, the shipped demo model under such a name the demo family's."""
    monkeypatch.delenv("DIFFRL_MODEL_FAMILY", raising=False)
    assert resolve_family(None, flux3_dir) is get_family("flux3_image")
    shapes = shutil.copytree(SHIPPED_DEMO_MODEL, tmp_path / "my-shapes")
    assert resolve_family(None, shapes) is get_family("demo")
    with pytest.raises(ModelLoadError, match=rf"^{shapes} is a checkpoint of the demo family \(its model_index.json "
                                             r"names it\), not of FLUX 3: pass --diffusion-model-family demo$"):
        get_family("flux3_image").load(shapes)


@pytest.mark.parametrize("family", ["demo", "qwen_image", "ltx2", "krea2", "wan2_2", "cosmos3", "chroma", "sana",
                                    "lumina2", "cogview4", "hidream"])
def test_every_family_names_a_flux3_checkpoint_before_reading_its_settings(flux3_dir, family):
    """Families read their settings (model index, scheduler) first: on a FLUX 3 checkpoint they said "corrupt file:
    …/model_index.json (bad 'diffrl' block …)", "the scheduler uses dynamic shifting" or "a Flux3ModularPipeline
    checkpoint (image-to-video or another conditioned mode)"."""
    with pytest.raises(ModelLoadError, match=rf"^{flux3_dir} is a checkpoint of the flux3_image family \(.*\), not of "
                                             r".*: pass --diffusion-model-family flux3_image$"):
        get_family(family).load(flux3_dir)


def test_a_recipe_of_another_family_without_model_path_asks_for_it(tmp_path, capsys):
    """Without --model-path a run loads the shipped demo model, so a forgotten flag read as a wrong-family error
    about the demo model."""
    (tmp_path / "prompts.txt").write_text('a sign that says "OPEN"\n')
    assert main(["train", "--recipe", "sd35-grpo-ocr", "--prompt-data", str(tmp_path / "prompts.txt"), "--device",
                 "cpu", "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --model-path: --recipe sd35-grpo-ocr trains a checkpoint of the sd3 family; pass its directory as "
        "--model-path DIR (without it the run would load the shipped demo model)")
    assert not (tmp_path / "run").exists()


def test_a_hub_id_as_model_path_says_that_only_local_directories_are_read(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text('a sign that says "OPEN"\n')
    assert main(["train", "--recipe", "sd35-grpo-ocr", "--model-path", "stabilityai/stable-diffusion-3.5-medium",
                 "--prompt-data", "prompts.txt", "--device", "cpu", "--output-dir", "run"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: model directory not found: stabilityai/stable-diffusion-3.5-medium (a hub id? diffrl reads local "
        "directories only: download it first, e.g. `huggingface-cli download stabilityai/stable-diffusion-3.5-medium "
        "--local-dir DIR`, and pass DIR)")
    (tmp_path / "models").mkdir()
    assert main(["evaluate", "--model-path", "models/missing", "--output-dir", "out"]) == 2  # a local folder's: no hint
    assert capsys.readouterr().err.strip() == "error: model directory not found: models/missing"
    assert not (tmp_path / "run").exists()
