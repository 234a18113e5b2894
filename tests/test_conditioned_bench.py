"""benchmarks/recipe_runs.py on the image-conditioned recipes (editing, image to video) at tiny size on CPU: the
recipe's image-conditioned checkpoint variant built under its own folder name, a prompts.jsonl whose rows each name
a distinct generated condition image at the run's size, rollouts and updates through the recipe's settings, and the
JSON saying which variant ran and how many condition images each row carried."""

import json

import pytest
import torch
from benchmark_scripts import load_benchmark
from PIL import Image

from diffrl.recipes import recipe_names, recipe_overrides

# Per recipe: a size its tiny checkpoint takes (FLUX.2 takes references of at least 64 px a side), its model index's
# pipeline class, and steps and samples cut to CPU size (the SDE window keeps room for the recipe's SDE steps). The
# recipes compile on a GPU; these runs of their paths stay eager (compiling on 2 cores costs minutes; compiled and
# checkpointed training is tested in tests/test_checkpointing.py and tests/test_compile*.py).
TINY = {
    "wan22-i2v-grpo-pickscore": (["--height", "16", "--width", "32", "--num-frames", "5"], "WanImageToVideoPipeline",
                                 {"diffusion_num_steps": 2, "eval_num_steps": 2, "n_samples_per_prompt": 2,
                                  "compile": False}),
    "flux1-kontext-grpo-pickscore": (["--height", "32", "--width", "48"], "FluxKontextPipeline",
                                     {"diffusion_num_steps": 4, "n_samples_per_prompt": 2, "compile": False}),
    "qwen-image-edit-grpo-pickscore": (["--height", "32", "--width", "48"], "QwenImageEditPlusPipeline",
                                       {"diffusion_num_steps": 4, "n_samples_per_prompt": 2,
                                        "condition_image_size": 64,  # the recipe's 384² references: 576 tokens
                                        "compile": False}),
    "flux2-dev-edit-grpo-pickscore": (["--height", "64", "--width", "64"], "Flux2Pipeline",
                                      {"diffusion_num_steps": 4, "n_samples_per_prompt": 2, "compile": False}),
    # The family's own checkpoints: LTX-2.3's does image to video on rows with a first frame, FLUX 3 Klein's edits.
    "ltx23-i2v-grpo-pickscore": (["--height", "64", "--width", "96", "--num-frames", "9"], "LTX2Pipeline",
                                 {"diffusion_num_steps": 4, "diffusion_sde_window_range": [0, 4],
                                  "n_samples_per_prompt": 2}),
    "flux3-klein-edit-nft-pickscore": (["--height", "32", "--width", "48"], None,
                                       {"diffusion_num_steps": 4, "n_samples_per_prompt": 2, "compile": False}),
}
# The default run's (about 25 s together on 2 cores); the others add about 45 s.
FAST = {"wan22-i2v-grpo-pickscore", "flux1-kontext-grpo-pickscore", "qwen-image-edit-grpo-pickscore"}


@pytest.fixture
def recipe_runs(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the script sets it: restored afterwards
    yield load_benchmark("recipe_runs", monkeypatch)
    torch.use_deterministic_algorithms(False)  # LTX-2.3's recipe runs in deterministic mode


@pytest.mark.parametrize("recipe", [r if r in FAST else pytest.param(r, marks=pytest.mark.slow) for r in TINY])
def test_an_image_conditioned_recipe_runs_on_its_variant_with_condition_images(recipe_runs, tmp_path, recipe):
    size, pipeline, flags = TINY[recipe]
    checkpoint, work, out = tmp_path / recipe_runs.checkpoint_name(recipe), tmp_path / "work", tmp_path / "r.json"
    recipe_runs.main(["--recipe", recipe, "--checkpoint", str(checkpoint), "--tiny", "--device", "cpu",
                      "--work-dir", str(work), "--rollout-batch-size", "1", "--num-rollout", "2",
                      "--flags", json.dumps(flags), "--out", str(out), *size])
    report = json.loads(out.read_text())
    rows = report["rollouts"]
    assert len(rows) == 2 and all(row["seconds_per_sample"] > 0 and row["train_pairs"] > 0 for row in rows)
    assert report["gflop_per_forward"] > 0 and report["stopped"] is None and report["text_encoder_params_b"] > 0
    variant = recipe_runs.recipe_variant(recipe)
    index = json.loads((checkpoint / "model_index.json").read_text())
    if variant is None:
        assert report["checkpoint_variant"] is None and checkpoint.name == f"{report['family']}-random"
    else:
        assert report["checkpoint_variant"]["name"] == variant.name and index["_class_name"] == pipeline
        assert checkpoint.name == f"{report['family']}-{variant.name}-random"
    if pipeline is not None:
        assert index["_class_name"] == pipeline
    # The prompt set: a .jsonl (no prompts.txt), each row naming its own distinct image at the run's size.
    height, width = int(size[1]), int(size[3])
    assert report["condition_images_per_row"] == 1 and report["condition_image_size"] == [height, width]
    lines = (work / "prompts.jsonl").read_text().splitlines()
    assert not (work / "prompts.txt").exists() and len(lines) == report["condition_images"] == 8
    images = [json.loads(line)["image"] for line in lines]
    pictures = [(work / name).read_bytes() for name in images]
    assert len(set(images)) == len(set(pictures)) == 8
    assert all(Image.open(work / name).size == (width, height) for name in images)


def test_each_image_conditioned_recipe_has_its_checkpoint_folder(recipe_runs, tmp_path):
    """The variant recipes' checkpoints are named apart from their family's text-only one (bench_recipes.sh keeps
    both in runs/), the -gpu aliases as their recipe; every other recipe keeps `<family>-random`."""
    conditioned = {n for n in recipe_names() if recipe_overrides(n, "cuda").get("condition_images") == "required"
                   and not n.startswith("shapes-")}
    assert {n.removesuffix("-gpu") for n in conditioned} == set(TINY)
    for name in conditioned:
        family = recipe_overrides(name, "cuda")["diffusion_model_family"]
        variant = recipe_runs.recipe_variant(name)
        expected = f"{family}-{variant.name}-random" if variant else f"{family}-random"
        assert recipe_runs.checkpoint_name(name) == expected
    assert recipe_runs.checkpoint_name("wan22-grpo-pickscore") == "wan2_2-random"
    assert recipe_runs.checkpoint_name("wan22-i2v-grpo-pickscore-gpu") == "wan2_2-i2v-random"
    # FLUX.2 [dev]'s transformer (the klein one is the family's default), with the disk it needs.
    dev = recipe_runs.recipe_variant("flux2-dev-edit-grpo-pickscore").size("flux2")
    assert dev.real == {"model": "dev"} and dev.disk_gb == 66
    wan = recipe_runs.recipe_variant("wan22-i2v-grpo-pickscore").size("wan2_2")
    assert wan.save == {"shared_experts": True, "image_to_video": True}


def test_a_text_only_checkpoint_is_refused_for_a_variant_recipe(recipe_runs, tmp_path):
    """A checkpoint already at --checkpoint that is not the recipe's variant stops the run before it loads."""
    checkpoint = tmp_path / "wan2_2-random"
    checkpoint.mkdir()
    (checkpoint / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    with pytest.raises(SystemExit, match="holds a WanPipeline checkpoint; this recipe needs a WanImageToVideoPipeline"):
        recipe_runs.main(["--recipe", "wan22-i2v-grpo-pickscore", "--checkpoint", str(checkpoint), "--tiny",
                          "--device", "cpu", "--work-dir", str(tmp_path / "work")])
