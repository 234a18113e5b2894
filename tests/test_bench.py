"""`diffrl bench`: one run measures the transformer, the decode, the engine and, where the family has one,
diffusers' pipeline on the same weights; bad flags are refused naming them."""

import json

import pytest
import torch

from diffrl.cli.bench import BenchConfig, bench
from diffrl.cli.main import main as cli_main
from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint


def test_bench_reports_every_part_for_a_family_with_a_reference_pipeline(tmp_path):
    model = save_random_checkpoint(tmp_path / "sd3-tiny")
    out = tmp_path / "bench.json"
    results = bench(BenchConfig(model_path=model, device="cpu", dtype="float32", resolution=32, n=2, ms=(1, 2),
                                steps=2, repeats=1, guidance_scale=4.5, out=out))
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["family"] == "sd3" and results["resolution"] == 32
    step = results["transformer"]
    # FLOPs per sample barely depend on the batch (on CPU the per-row modulation MLPs run once per
    # distinct row, and the batch's rows share a timestep: a fraction of a percent here).
    assert step[1]["gflop_per_sample_step"] == pytest.approx(step[2]["gflop_per_sample_step"], rel=1e-2)
    assert step[1]["gflop_per_sample_step"] > 0
    for m in (1, 2):
        engine = results["engine"][m]
        assert engine["images_per_s"] == pytest.approx(1 / engine["s_per_image"])
        assert engine["transformer_share"] == pytest.approx(
            2 * step[2]["ms_per_sample_step"] / 1000 / engine["s_per_image"])
    assert results["pipeline"]["class"] == "StableDiffusion3Pipeline"
    assert results["pipeline"][2]["s_per_image"] > 0 and "pipeline_batch2_over_engine" in results
    # The like-for-like row: the engine making images only, as the pipeline does.
    assert results["engine_plain"]["s_per_image"] > 0
    assert results["pipeline_over_engine_plain"] == pytest.approx(
        results["pipeline"][2]["s_per_image"] / results["engine_plain"]["s_per_image"])


def test_bench_times_the_engine_as_a_lora_training_loop_holds_it(tmp_path, monkeypatch):
    """--lora-rank and --autocast: the engine runs with the adapter on its blocks and its forwards under bf16
    autocast, as a LoRA training run's rollout does; the results say so."""
    from diffrl.models import base

    model = save_random_checkpoint(tmp_path / "sd3-tiny")
    seen = []
    real = base.FamilyAdapter.forward_precision

    def spy(self):
        seen.append((self.autocast_dtype, any("lora_A" in n for n, _ in self.transformer.named_parameters())))
        return real(self)

    monkeypatch.setattr(base.FamilyAdapter, "forward_precision", spy)
    results = bench(BenchConfig(model_path=model, device="cpu", dtype="float32", resolution=32, n=2, ms=(2,), steps=2,
                                repeats=1, guidance_scale=4.5, lora_rank=4, autocast=True, reference_pipeline=False))
    assert results["lora_rank"] == 4 and results["autocast"] is True and results["engine"][2]["s_per_image"] > 0
    assert seen and set(seen) == {(torch.bfloat16, True)}


def test_bench_refuses_bad_flags(capsys):
    assert cli_main(["bench", "--device", "cpu", "--n", "2", "--ms", "3"]) == 2
    assert "--ms must lie in 1..--n (2)" in capsys.readouterr().err
    assert cli_main(["bench", "--device", "cpu", "--dtype", "float16"]) == 2
    assert "--dtype must be float32 or bfloat16" in capsys.readouterr().err
    assert cli_main(["bench", "--device", "cpu", "--lora-rank", "-1"]) == 2
    assert "--lora-rank must be >= 0" in capsys.readouterr().err


def test_bench_times_a_video_family_and_refuses_frames_for_an_image_family(tmp_path, tiny_model_dir, capsys):
    from diffrl.models.random_checkpoints.wan2_2 import (
        save_random_checkpoint as save_wan,
    )

    model = save_wan(tmp_path / "wan-tiny")
    results = bench(BenchConfig(model_path=model, device="cpu", dtype="float32", resolution=16, num_frames=5, n=2,
                                ms=(2,), steps=2, repeats=1, guidance_scale=1.0))
    assert results["family"] == "wan2_2" and results["num_frames"] == 5
    assert results["engine"][2]["s_per_image"] > 0 and results["decode_ms_per_image"]["family_decode"] > 0
    assert results["pipeline"]["class"] == "WanPipeline" and results["pipeline"][2]["s_per_image"] > 0
    assert results["pipeline"][2]["samples_per_call"] == 2 and results["pipeline"][2]["calls"] == 1
    printed = capsys.readouterr().out
    assert "WanPipeline,  2 videos per call: " in printed and " s per video" in printed
    assert "transformer batch  2: " in printed  # one forward for the batch
    with pytest.raises(ValueError, match="--num-frames 5: the demo family generates images"):
        bench(BenchConfig(model_path=tiny_model_dir, device="cpu", num_frames=5))


@pytest.mark.parametrize(("family_name", "pipeline"), [("qwen_image", "QwenImagePipeline"),
                                                       ("flux3_image", "Flux3ModularPipeline")])
def test_bench_gives_the_pipeline_the_cfg_scale_in_its_own_terms(tmp_path, family_name, pipeline):
    """Qwen-Image's CFG scale is `true_cfg_scale` (on only with a negative prompt), FLUX 3's is its modular
    pipeline's guider: with CFG on, the pipeline runs two transformer forwards a step, with it off one."""
    import importlib

    from diffrl.cli.bench import pipeline_s_per_image
    from diffrl.models.registry import resolve_family

    save = importlib.import_module(f"diffrl.models.random_checkpoints.{family_name}").save_random_checkpoint
    model = save(tmp_path / family_name)
    results = bench(BenchConfig(model_path=model, diffusion_model_family=family_name, device="cpu", dtype="float32",
                                resolution=32, n=2, ms=(2,), steps=2, repeats=1))
    assert results["pipeline"]["class"] == pipeline and results["pipeline"][2]["s_per_image"] > 0
    family = resolve_family(family_name, model).load(model)
    forwards = []
    family.transformer.register_forward_hook(lambda *_: forwards.append(1))
    pipe = family.reference_pipeline()
    for guidance, per_step in ((4.0, 2), (1.0, 1)):
        forwards.clear()
        pipeline_s_per_image(pipe, torch.device("cpu"), 1, (32, 32), 2, guidance, 1,
                             inputs=family.reference_pipeline_kwargs())
        assert len(forwards) == 2 * 2 * per_step  # a warm-up call and a timed one, two steps each


def test_bench_times_a_pipeline_that_takes_one_sample_per_call(tmp_path, capsys):
    """Cosmos3OmniPipeline makes one sample a call (no count argument): a group of n is n calls of one; it was
    called with num_images_per_prompt and the bench ended in a TypeError traceback after the engine's timings."""
    from diffrl.models.random_checkpoints.cosmos3 import save_random_checkpoint

    model = save_random_checkpoint(tmp_path / "cosmos3-tiny")
    results = bench(BenchConfig(model_path=model, device="cpu", dtype="float32", height=16, width=32, num_frames=5,
                                n=2, ms=(1, 2), steps=2, repeats=1, guidance_scale=4.0))
    assert results["pipeline"]["class"] == "Cosmos3OmniPipeline"
    assert results["pipeline"][1]["s_per_image"] > 0 and results["pipeline"][2]["s_per_image"] > 0


def test_bench_says_a_cosmos3_group_is_calls_and_forwards_of_one_sample(tmp_path, capsys):
    """Cosmos3's pipeline makes one video a call and its transformer's forward takes one sample: the bench's lines
    name n calls (and n forwards) of one, not n "images per call"."""
    from diffrl.models.random_checkpoints.cosmos3 import save_random_checkpoint

    model = save_random_checkpoint(tmp_path / "cosmos3-tiny")
    results = bench(BenchConfig(model_path=model, device="cpu", dtype="float32", height=16, width=32, num_frames=5,
                                n=2, ms=(2,), steps=2, repeats=1, guidance_scale=4.0))
    printed = capsys.readouterr().out
    assert "images per call" not in printed and "videos per call" not in printed
    assert "Cosmos3OmniPipeline,  1 call of one video: " in printed
    assert "Cosmos3OmniPipeline,  2 calls of one video: " in printed
    assert "transformer batch  2 (2 forwards of one sample): " in printed
    assert "engine M=2 : " in printed and " s per video (" in printed
    assert results["transformer_one_sample_per_forward"] is True
    assert results["pipeline"][2]["samples_per_call"] == 1 and results["pipeline"][2]["calls"] == 2


@pytest.mark.parametrize("family_name", ["z_image", "krea2"])
def test_bench_gives_a_pipeline_counting_cfg_from_zero_its_own_scale(tmp_path, family_name):
    """Krea-2's and Z-Image's pipelines take g = s − 1: the engine's scale 1 (CFG off) is their 0, one sample's rows
    a step; with CFG on, two (cond and uncond, in one forward or two). Their scale was passed unconverted, so a
    CFG-off bench timed the pipeline with CFG on."""
    import importlib

    from diffrl.cli.bench import pipeline_s_per_image
    from diffrl.models.registry import resolve_family

    save = importlib.import_module(f"diffrl.models.random_checkpoints.{family_name}").save_random_checkpoint
    model = save(tmp_path / family_name)
    family = resolve_family(family_name, model).load(model)
    assert family.reference_guidance_scale(6.0) == 5.0
    rows = []

    def count_rows(module, args, kwargs, output):
        x = kwargs.get("x", kwargs.get("hidden_states", args[0] if args else None))
        rows.append(len(x))  # Z-Image: a list of samples; Krea-2: a batch tensor

    family.transformer.register_forward_hook(count_rows, with_kwargs=True)
    pipe = family.reference_pipeline()
    for scale, per_step in ((4.0, 2), (1.0, 1)):
        rows.clear()
        pipeline_s_per_image(pipe, torch.device("cpu"), 1, (32, 32), 2, family.reference_guidance_scale(scale), 1,
                             inputs=family.reference_pipeline_kwargs())
        assert sum(rows) == 2 * 2 * per_step  # a warm-up call and a timed one, two steps each
