"""`diffrl pretrain` on a tiny model: loss falls on a fixed batch, checkpoints resume, the CLI works."""

import json

import pytest
import torch

from diffrl.cli.main import main as cli_main
from diffrl.models.demo import SHIPPED_DEMO_MODEL, DemoFamily
from diffrl.train.pretrain import PretrainConfig, flow_matching_loss, pretrain

TINY = ["--num-attention-heads", "2", "--attention-head-dim", "8", "--num-layers", "1",
        "--num-single-layers", "1", "--text-d-model", "16"]


def test_flow_matching_loss_decreases_on_a_fixed_batch(tiny_family):
    from diffrl.data.shapes import render_prompt

    prompts = ["a red circle", "two squares", "a blue triangle", "a green diamond"]
    images = torch.stack([torch.from_numpy(render_prompt(p, i)).permute(2, 0, 1) for i, p in enumerate(prompts)]) / 255
    family = tiny_family
    params = list(family.transformer.parameters()) + list(family.text_encoder.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    g = torch.Generator().manual_seed(0)
    x0 = family.encode_images(images)
    sigma = torch.rand(4, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    losses = []
    for _ in range(30):
        loss = flow_matching_loss(family, family.transformer, x0, family.encode_tokens(*family.tokenize(prompts)), sigma, noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_pretrain_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "run"
    args = ["pretrain", "--output-dir", str(out), "--steps", "2", "--batch-size", "2", "--num-workers", "0",
            "--checkpoint-every", "2", "--sample-steps", "1", "--log-every", "1", *TINY]
    assert cli_main(args) == 0
    assert (out / "checkpoints" / "step-0000002" / "train_state.pt").is_file()
    assert (out / "samples" / "step-0000002.png").is_file()
    model = DemoFamily.load(out / "final")
    assert sum(p.numel() for p in model.transformer.parameters()) < 100_000  # the tiny size was applied
    # Without --resume a non-empty run folder is refused (nothing is overwritten).
    assert cli_main(args) == 2
    # --resume continues at the saved step with the saved optimizer state.
    cfg = PretrainConfig(output_dir=out, steps=4, batch_size=2, num_workers=0, checkpoint_every=100,
                         sample_steps=1, log_every=1, resume=True, num_attention_heads=2, attention_head_dim=8,
                         num_layers=1, num_single_layers=1, text_d_model=16)
    pretrain(cfg)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    state = torch.load(out / "checkpoints" / "step-0000004" / "train_state.pt", weights_only=True)
    assert state["step"] == 4 and state["optimizer"]["state"]


def test_cli_reports_a_broken_model_in_one_line(tmp_path, capsys):
    assert cli_main(["evaluate", "--model-path", str(tmp_path / "missing-demo")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model directory not found") and "\n" not in err


def test_evaluate_a_checkpoint_with_the_trainers_balanced_protocol(tiny_model_dir, tmp_path):
    """`diffrl evaluate --checkpoint … --images-per-category N`: the trainer's held-out images."""
    import json

    from diffrl.cli.evaluate import EvaluateConfig, evaluate
    from diffrl.data.shapes import test_prompts
    from diffrl.evaluation.shapes import balanced_eval_set, evaluate_prompts
    from diffrl.models.checkpoint import load_model

    family = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in family.transformer.parameters():
            p.mul_(0.9)
    family.save(tmp_path / "ckpt" / "model")
    report = evaluate(EvaluateConfig(model_path=tiny_model_dir, checkpoint=tmp_path / "ckpt", images_per_category=2,
                                     seed=10_000, num_steps=2, guidance_scale=1.0, device="cpu",
                                     output_dir=tmp_path / "eval"))
    prompts, seeds = balanced_eval_set(test_prompts(), 2)
    records, _ = evaluate_prompts(load_model(tiny_model_dir, tmp_path / "ckpt"), prompts, num_seeds=seeds,
                                  seed=10_000, num_steps=2, guidance_scale=1.0)
    samples = [json.loads(line) for line in (tmp_path / "eval" / "records.jsonl").read_text().splitlines()]
    assert len(samples) == sum(seeds) > len(prompts)  # categories with one prompt get several seeds
    assert [(s["prompt"], s["seed"], s["score"]) for s in samples] == [(r.prompt, r.seed, r.score) for r in records]
    assert sum(c["n"] for c in report["categories"].values()) == len(samples)


def test_time_boxed_pretraining_has_no_step_budget_unless_given():
    from diffrl.train.pretrain import step_budget

    assert step_budget(PretrainConfig()) == 2000
    assert step_budget(PretrainConfig(max_minutes=7)) is None  # runs until the time is up
    assert step_budget(PretrainConfig(max_minutes=7, steps=500)) == 500


def test_size_flags_that_the_loaded_model_overrides_are_refused(tmp_path, capsys):
    """--init-from and --resume take the size of the model they load: a size flag that says otherwise was silently
    ignored (--init-from) or failed with a load_state_dict traceback (--resume)."""
    tiny = ["--batch-size", "2", "--num-workers", "0", "--sample-steps", "1", "--device", "cpu"]
    out = tmp_path / "init"
    assert cli_main(["pretrain", "--output-dir", str(out), "--steps", "1", "--init-from", str(SHIPPED_DEMO_MODEL),
                     "--num-layers", "3", *tiny]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --num-layers 3: --init-from {SHIPPED_DEMO_MODEL} has 2, and its size is the model's; drop --num-layers")
    assert not out.exists()  # nothing written: the same command without the flag runs in that folder
    run = tmp_path / "run"
    assert cli_main(["pretrain", "--output-dir", str(run), "--steps", "1", *TINY, *tiny]) == 0
    config = (run / "config.json").read_text()
    assert cli_main(["pretrain", "--output-dir", str(run), "--steps", "2", "--resume", "--num-single-layers", "4",
                     *tiny]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: --num-single-layers 4: --resume ({run / 'checkpoints' / 'step-0000001'}) has 1")
    assert (run / "config.json").read_text() == config
    # Resumed without the size flags, the run keeps its checkpoint's size.
    assert cli_main(["pretrain", "--output-dir", str(run), "--steps", "2", "--resume", *tiny]) == 0
    assert DemoFamily.load(run / "final").config.transformer["num_single_layers"] == 1


@pytest.mark.parametrize("flag, value, message", [
    ("--steps", "0", "--steps must be >= 1, got 0"), ("--batch-size", "0", "--batch-size must be >= 1, got 0"),
    ("--checkpoint-every", "0", "--checkpoint-every must be >= 1, got 0"), ("--lr", "-1", "--lr must be >= 0, got -1.0"),
    ("--cfg-dropout", "2", "--cfg-dropout must be in [0, 1], got 2.0"), ("--max-minutes", "0", "--max-minutes must be > 0"),
    ("--attention-head-dim", "6", "--attention-head-dim must be a multiple of 4"),
    ("--rope-theta", "1", "--rope-theta must be > 1, got 1"), ("--shift", "0", "--shift must be > 0, got 0.0"),
])
def test_values_that_fail_late_or_never_end_are_refused(tmp_path, capsys, flag, value, message):
    """--steps 0 trained without end; --checkpoint-every 0 divided by zero; --batch-size 0 and --lr -1 stopped in
    torch without naming the flag."""
    out = tmp_path / "run"
    assert cli_main(["pretrain", "--output-dir", str(out), flag, value, "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {message}")
    assert not out.exists()


def test_profile_steps_write_where_a_step_goes(tmp_path):
    from diffrl.cli.main import main as cli_main

    out = tmp_path / "run"
    assert cli_main(["pretrain", "--output-dir", str(out), "--steps", "22", "--profile-steps", "2", *TINY,
                     "--batch-size", "2", "--num-workers", "0", "--sample-steps", "1", "--device", "cpu",
                     "--checkpoint-every", "100"]) == 0
    text = (out / "profile.txt").read_text()
    assert text.startswith("2 optimizer steps") and "aten::mm" in text and "Optimizer.step" in text


def test_the_transformer_trains_in_the_precision_pretraining_asks_for(tmp_path, monkeypatch):
    """`velocity` runs the transformer in the family's own precision context, which replaces any autocast around
    it: pretraining must set bf16 on the family, or a --bf16 run on a GPU computes every matmul in fp32 (as the
    OCR model's first GPU runs did: fp32 attention and SIMT GEMMs in their profile)."""
    import diffrl.train.pretrain as pretrain_module
    from diffrl.train.pretrain import training_autocast_dtype

    assert training_autocast_dtype(torch.device("cuda"), True) is torch.bfloat16
    assert training_autocast_dtype(torch.device("cuda"), False) is None
    assert training_autocast_dtype(torch.device("cpu"), True) is None
    # The wiring, on the CPU: whatever precision the run resolves is what the transformer's linears compute in.
    seen = []
    monkeypatch.setattr(pretrain_module, "training_autocast_dtype", lambda device, bf16: torch.bfloat16)
    original = torch.nn.functional.linear

    def recording_linear(x, weight, bias=None):
        y = original(x, weight, bias)
        seen.append(y.dtype)
        return y

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    pretrain(PretrainConfig(output_dir=tmp_path / "run", steps=1, batch_size=2, num_workers=0, checkpoint_every=100,
                            sample_steps=1, device="cpu", num_attention_heads=2, attention_head_dim=8, num_layers=1,
                            num_single_layers=1, text_d_model=16))
    assert seen and torch.bfloat16 in seen


def test_rope_theta_is_the_saved_models_and_a_loaded_model_keeps_its_own(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli_main(["pretrain", "--output-dir", str(run), "--steps", "1", "--rope-theta", "100", *TINY,
                     "--batch-size", "2", "--num-workers", "0", "--sample-steps", "1", "--device", "cpu"]) == 0
    assert DemoFamily.load(run / "final").transformer.pos_embed.theta == 100
    # The shipped model was saved without the key: it has diffusers' default, and another value is refused.
    out = tmp_path / "init"
    assert cli_main(["pretrain", "--output-dir", str(out), "--steps", "1", "--init-from", str(SHIPPED_DEMO_MODEL),
                     "--rope-theta", "100", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --rope-theta 100: --init-from {SHIPPED_DEMO_MODEL} has 10000, and its size is the model's; "
        "drop --rope-theta")


@pytest.mark.parametrize("world, glyph_grid", [("shapes", False), ("ocr", True)])
def test_workers_tokenize_and_dropped_prompts_get_the_empty_prompts_tokens(world, glyph_grid):
    """The render workers tokenize (TokenizedBatches, with the family's picklable tokenizer); CFG dropout then swaps
    rows for the empty prompt's tokens: the same ids and mask as tokenizing the prompts with the dropped ones blank."""
    import pickle

    from diffrl.train.pretrain import TokenizedBatches, cfg_dropped, random_family, training_stream

    cfg = PretrainConfig(world=world, glyph_grid=glyph_grid, num_attention_heads=2, attention_head_dim=8,
                         num_layers=1, num_single_layers=1, text_d_model=16)
    family = random_family(cfg.demo_config(), seed=0, batch_invariant=False, world=world)
    stream = iter(training_stream(world, 0, family.config))
    rows = [next(stream) for _ in range(6)]
    collate = pickle.loads(pickle.dumps(TokenizedBatches(family.prompt_tokenizer())))  # as a spawned worker has it
    prompts, images, ids, mask = collate(rows)
    assert images.shape[0] == 6 and ids.shape == mask.shape and ids.shape[0] == 6
    keep = torch.tensor([True, False, True, True, False, True])
    got = cfg_dropped(ids, mask, keep, *family.tokenize([""]))
    want = family.tokenize([p if k else "" for p, k in zip(prompts, keep.tolist())])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert not torch.equal(got[0], ids)  # something was dropped


def test_shift_is_the_saved_models_schedule_and_a_loaded_model_keeps_its_own(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli_main(["pretrain", "--output-dir", str(run), "--steps", "1", "--shift", "1", *TINY,
                     "--batch-size", "2", "--num-workers", "0", "--sample-steps", "1", "--device", "cpu"]) == 0
    family = DemoFamily.load(run / "final")
    assert family.config.shift == 1.0
    assert torch.allclose(family.sigmas(10, 64, 64)[:-1], torch.linspace(1, 0.1, 10))  # unshifted: the sampler's steps too
    out = tmp_path / "init"
    assert cli_main(["pretrain", "--output-dir", str(out), "--steps", "1", "--init-from", str(SHIPPED_DEMO_MODEL),
                     "--shift", "1", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --shift 1.0: --init-from {SHIPPED_DEMO_MODEL} has 3.0, and its schedule is the model's; drop --shift")


def test_a_model_saved_in_bf16_loads_as_its_rounded_weights_at_half_the_bytes(tmp_path):
    """A shipped model's weights may be stored in bf16 (half the bytes in the repository and on the device's way);
    loading casts them back to fp32, each weight the bf16 rounding of the saved one."""
    from safetensors import safe_open

    from diffrl.train.pretrain import random_family

    cfg = PretrainConfig(world="ocr", glyph_grid=True, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                         num_single_layers=1, text_d_model=16)
    family = random_family(cfg.demo_config(), seed=0, batch_invariant=False, world="ocr")
    family.save(tmp_path / "fp32")
    family.save(tmp_path / "bf16", weights_dtype=torch.bfloat16)
    sizes = {}
    for kind in ("fp32", "bf16"):
        files = sorted((tmp_path / kind).rglob("*.safetensors"))
        sizes[kind] = sum(f.stat().st_size for f in files)
    with safe_open(str(tmp_path / "bf16" / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert sizes["bf16"] < 0.55 * sizes["fp32"]
    loaded = DemoFamily.load(tmp_path / "bf16")
    assert loaded.config.glyph_grid and loaded.config.width == family.config.width
    for module, original in ((loaded.transformer, family.transformer), (loaded.text_encoder, family.text_encoder)):
        want = original.state_dict()
        for name, value in module.state_dict().items():
            assert value.dtype == torch.float32
            assert torch.equal(value, want[name].to(torch.bfloat16).float()), name


def test_an_image_predicting_model_gives_the_velocity_of_its_image_and_is_the_saved_models(tmp_path, capsys):
    """--prediction image: the transformer's output is read as the clean image x0 and `velocity` returns
    (x_t − x0)/σ (σ held at ≥ 0.05), so an ODE step to σ = 0 lands on the predicted image; saved and loaded with it."""
    from diffrl.models.base import Latents
    from diffrl.models.flux3_image import run_flux3_transformer

    run = tmp_path / "run"
    assert cli_main(["pretrain", "--output-dir", str(run), "--steps", "1", "--prediction", "image", *TINY,
                     "--batch-size", "2", "--num-workers", "0", "--sample-steps", "1", "--device", "cpu"]) == 0
    family = DemoFamily.load(run / "final")
    assert family.config.prediction == "image"
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(3, 256, family.config.in_channels, generator=g)
    latents = Latents(x_t, family.prepare_ids())
    cond = family.encode_prompts(["a red circle", "two squares", "a blue triangle"])
    sigma = torch.tensor([0.9, 0.3, 0.01])
    x0 = run_flux3_transformer(family, family.transformer, latents, sigma, cond)
    v = family.velocity(family.transformer, latents, sigma, cond, None, 1.0)
    torch.testing.assert_close(v, (x_t - x0) / torch.tensor([0.9, 0.3, 0.05]).view(3, 1, 1))
    torch.testing.assert_close(x_t[:2] - sigma[:2].view(2, 1, 1) * v[:2], x0[:2])  # one ODE step to σ = 0
    # A model's output is its own: another --prediction on --init-from is refused, and so is an unknown one.
    out = tmp_path / "init"
    assert cli_main(["pretrain", "--output-dir", str(out), "--steps", "1", "--init-from", str(SHIPPED_DEMO_MODEL),
                     "--prediction", "image", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --prediction image: --init-from {SHIPPED_DEMO_MODEL} predicts velocity, and its output is the "
        "model's; drop --prediction")
    index = json.loads((run / "final" / "model_index.json").read_text())
    index["diffrl"]["prediction"] = "noise"
    (run / "final" / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="prediction 'noise': a demo model predicts one of velocity, image"):
        DemoFamily.load(run / "final")
