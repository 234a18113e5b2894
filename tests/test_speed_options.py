"""The forward's speed options (`--attention-backend`, `--compile-mode`, `--fuse-qkv`, `--vae-decode-batch`):
each parses, reaches the place it acts on for the trainer and the engines alike, refuses contradictory
combinations naming the flags, and where it runs on a CPU leaves the outputs as the default computes them."""

import dataclasses

import pytest
import torch

from diffrl.cli.main import main as cli_main
from diffrl.cli.main import parse
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.models import attention
from diffrl.models.base import repeated_blocks
from diffrl.models.batch_invariance import decode_rows
from diffrl.models.lora import LoraSpec, add_lora
from diffrl.models.random_checkpoints import sd3 as random_sd3
from diffrl.models.sd3 import SD3Family
from diffrl.models.speed import SpeedOptions
from diffrl.sampling import make_generators
from diffrl.train.config import TrainConfig
from diffrl.train.trainer import Trainer
from test_trainer import tiny_config


@pytest.fixture(scope="module")
def sd35_dir(tmp_path_factory):
    """A tiny SD3 with SD3.5's attention layout: q/k RMSNorm and a dual-attention (image-only) block."""
    sizes = random_sd3.tiny()
    sizes = dataclasses.replace(sizes, transformer={**sizes.transformer, "qk_norm": "rms_norm",
                                                    "dual_attention_layers": (0,)})
    return random_sd3.save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd35-tiny", sizes)


def _velocity_inputs(family, n=3):
    latents = family.prepare_latents(make_generators(range(n)), 32, 32)
    cond, uncond = family.encode_prompts(["a red cat"]).repeat(n), family.encode_prompts([""]).repeat(n)
    return latents, torch.tensor([0.9, 0.5, 0.2][:n]), cond, uncond


# ---------------------------------------------------------------------------------------------- parsing, refusals
def test_the_options_parse_for_train_serve_and_bench():
    cfg = parse(["train", "--compile", "--compile-mode", "max-autotune-no-cudagraphs", "--attention-backend", "cudnn",
                 "--fuse-qkv", "--vae-decode-batch", "0"])
    m = cfg.model
    assert (m.compile_mode, m.attention_backend, m.fuse_qkv, m.vae_decode_batch) == \
        ("max-autotune-no-cudagraphs", "cudnn", True, 0)
    assert cfg.model.speed_options() == SpeedOptions(attention_backend="cudnn", fuse_qkv=True, vae_decode_batch=0,
                                                     compile=True, compile_mode="max-autotune-no-cudagraphs")
    default = parse(["train"]).model
    assert (default.compile_mode, default.attention_backend, default.fuse_qkv, default.vae_decode_batch) == \
        ("default", "auto", False, None)
    for command in ("serve", "bench"):
        other = parse([command, "--compile", "--compile-mode", "max-autotune-no-cudagraphs", "--attention-backend",
                       "flash", "--fuse-qkv", "--vae-decode-batch", "4"])
        assert (other.compile_mode, other.attention_backend, other.fuse_qkv, other.vae_decode_batch) == \
            ("max-autotune-no-cudagraphs", "flash", True, 4)


@pytest.mark.parametrize(("flags", "message"), [
    (dict(compile_mode="max-autotune-no-cudagraphs"), "--compile-mode max-autotune-no-cudagraphs needs --compile"),
    (dict(vae_decode_batch=-1), "--vae-decode-batch must be >= 0"),
    (dict(attention_backend="flash", deterministic_mode=True), "--attention-backend flash with --deterministic-mode"),
    (dict(attention_backend="cudnn", deterministic_mode=True), "--attention-backend cudnn with --deterministic-mode"),
])
def test_contradictory_settings_are_refused_by_name(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.flat(**flags).check()


def test_deterministic_mode_keeps_the_kernels_it_allows():
    for backend in ("auto", "efficient", "math"):
        TrainConfig.flat(attention_backend=backend, deterministic_mode=True).check()


def test_the_command_line_refuses_in_one_line(capsys):
    assert cli_main(["train", "--deterministic-mode", "--attention-backend", "flash"]) == 2
    assert "error: --attention-backend flash with --deterministic-mode" in capsys.readouterr().err
    assert cli_main(["bench", "--device", "cpu", "--compile-mode", "max-autotune-no-cudagraphs"]) == 2
    assert "--compile-mode max-autotune-no-cudagraphs needs --compile" in capsys.readouterr().err


REDUCE_OVERHEAD = "--compile-mode reduce-overhead: CUDA graphs fail under per-block compilation"


def test_reduce_overhead_is_refused_with_its_reason(tiny_model_dir, capsys):
    """CUDA graphs under per-block compilation: every block of one kind replays one graph, so the next block's
    replay overwrites the output the previous one handed it (measured on an H200). Refused with the reason, with
    or without --compile, by the options, the train config, every command and the engines' builders."""
    from diffrl.serving.server import ServeConfig, build_engine
    from diffrl.models.compile import compile_blocks

    for compile in (True, False):
        with pytest.raises(ValueError, match=REDUCE_OVERHEAD):
            SpeedOptions(compile=compile, compile_mode="reduce-overhead").check()
        with pytest.raises(ValueError, match=REDUCE_OVERHEAD):
            TrainConfig.flat(compile=compile, compile_mode="reduce-overhead").check()
    for command in (["train"], ["bench-train"], ["serve"], ["bench"]):
        for compile in (["--compile"], []):
            assert cli_main([*command, "--device", "cpu", *compile, "--compile-mode", "reduce-overhead"]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"error: {REDUCE_OVERHEAD}") and err.count("\n") == 1, (command, err)
            assert "previous block's output" in err
    with pytest.raises(ValueError, match=REDUCE_OVERHEAD):
        build_engine(ServeConfig(model_path=tiny_model_dir, device="cpu", compile=True, compile_mode="reduce-overhead"))
    with pytest.raises(ValueError, match=REDUCE_OVERHEAD):
        compile_blocks(torch.nn.Module(), ["blocks"], mode="reduce-overhead")


def test_what_the_family_or_device_lacks_is_refused(tiny_family, sd35_dir):
    with pytest.raises(ValueError, match="--attention-backend efficient needs a CUDA device"):
        SpeedOptions(attention_backend="efficient").apply(tiny_family)
    with pytest.raises(ValueError, match="--attention-backend cudnn needs a CUDA device"):
        SpeedOptions(attention_backend="cudnn").apply(tiny_family)
    with pytest.raises(ValueError, match="--fuse-qkv: .* has no joint \\(SD3\\) attention"):
        SpeedOptions(fuse_qkv=True).apply(tiny_family)


def test_fuse_qkv_with_lora_on_every_stream_is_refused(tmp_path):
    """SD3's default LoRA targets wrap q, k and v of both joint streams: without SD3.5's image-only attention
    (not targeted) nothing is left to fuse, and the trainer refuses rather than doing nothing."""
    model = random_sd3.save_random_checkpoint(tmp_path / "sd3-tiny")
    cfg = tiny_config(model, tmp_path / "run", diffusion_model_family="sd3", use_lora=True, fuse_qkv=True)
    with pytest.raises(ValueError, match="--fuse-qkv: a LoRA adapter wraps the q/k/v projections of every attention "
                                         "stream \\(4\\)"):
        Trainer(cfg)


# ---------------------------------------------------------------------------------------------- compile mode
@pytest.mark.parametrize(("mode", "passed"), [("default", None),
                                             ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs")])
def test_compile_mode_reaches_every_block_of_the_shared_transformer(tiny_model_dir, tmp_path, monkeypatch, mode,
                                                                   passed):
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append((self, kw)))  # no compilation
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", compile=True, compile_mode=mode))
    family = trainer.policy.family
    blocks = repeated_blocks(family.transformer, family.block_lists)
    assert [m for m, _ in seen] == blocks and all(kw == {"mode": passed} for _, kw in seen)
    assert trainer.engine.family is family  # the engine samples through the same compiled blocks
    spec = trainer._engine_spec(family)
    assert (spec.compile, spec.compile_mode) == (True, mode)


def test_colocated_engine_process_and_server_apply_the_options(tiny_model_dir, monkeypatch):
    from diffrl.serving.colocated import EngineProcessSpec, _EngineServer
    from diffrl.serving.server import ServeConfig, build_engine

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    spec = EngineProcessSpec(model_path=str(tiny_model_dir), family="demo", compile=True,
                             compile_mode="max-autotune-no-cudagraphs", attention_backend="math", vae_decode_batch=0)
    server = _EngineServer(EngineProcessSpec.from_json(spec.to_json()))
    try:
        family = server.engine.family
        assert (family.attention_backend, family.vae_decode_batch) == ("math", 0)
    finally:
        server.loop.call_soon_threadsafe(server.loop.stop)
    spec_blocks = len(seen)
    engine = build_engine(ServeConfig(model_path=tiny_model_dir, device="cpu", compile=True, attention_backend="flash",
                                      vae_decode_batch=3))
    assert (engine.family.attention_backend, engine.family.vae_decode_batch) == ("flash", 3)
    assert spec_blocks and len(seen) == 2 * spec_blocks
    assert [kw["mode"] for kw in seen] == ["max-autotune-no-cudagraphs"] * spec_blocks + [None] * spec_blocks


# ---------------------------------------------------------------------------------------------- attention backend
def test_attention_backend_is_entered_around_every_forward_and_left_after(sd35_dir, monkeypatch):
    family = SD3Family.load(sd35_dir)
    inputs = _velocity_inputs(family)
    with torch.no_grad():
        reference = family.velocity(family.transformer, *inputs, 4.5)
    sdpa, flags = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        flags.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.flash_sdp_enabled()
    family.attention_backend = "math"
    with torch.no_grad():
        math = family.velocity(family.transformer, *inputs, 4.5)
    assert flags and set(flags) == {(False, True)}  # 3 attentions, each under the math kernel only
    assert torch.backends.cuda.flash_sdp_enabled() == before  # the restriction ends with the forward
    # The CPU's default kernel and the math one agree to float rounding (measured: below 1e-6).
    torch.testing.assert_close(math, reference, rtol=0, atol=1e-5)


def test_trainer_and_engine_share_the_attention_backend(tiny_model_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", attention_backend="math"))
    assert trainer.policy.family.attention_backend == "math" and trainer.engine.family is trainer.policy.family
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0  # one kernel for rollout and replay: still exact


# ---------------------------------------------------------------------------------------------- VAE decode batch
def test_decode_rows_calls_per_the_decode_batch():
    latents, calls = torch.randn(5, 2), []

    def decode(rows):
        calls.append(len(rows))
        return rows * 2

    for per_call, expected in ((None, [1] * 5), (2, [2, 2, 1]), (0, [5]), (8, [5])):
        calls.clear()
        assert torch.equal(decode_rows(decode, latents, per_call=per_call), latents * 2)
        assert calls == expected
    with pytest.raises(ValueError, match="--vae-decode-batch must be >= 0"):
        decode_rows(decode, latents, per_call=-1)


def test_vae_decode_batch_leaves_the_engines_images_as_the_default(sd35_dir):
    family = SD3Family.load(sd35_dir)
    request = RolloutRequest(prompt="a red cat", seed=5, num_outputs_per_prompt=3, num_inference_steps=2,
                             guidance_scale=4.5, height=32, width=32)
    images = {}
    for per_call in (None, 0, 2):
        family.vae_decode_batch = per_call
        images[per_call] = torch.stack([o.generated_output for o in Engine(family, EngineConfig()).generate(request)])
    # Batched convolutions round differently from one image per call (measured: below 1e-6 on this CPU).
    for per_call in (0, 2):
        torch.testing.assert_close(images[per_call], images[None], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- fused q/k/v
def test_fused_qkv_gives_the_unfused_velocity_and_gradients(sd35_dir):
    """SD3.5's layout (q/k RMSNorm, the image-only attention of a dual block), fp32 on CPU: the same velocity
    (measured: bit for bit here) and the same gradients on the projections' own weights (full finetune)."""
    results = []
    for fuse in (False, True):
        family = SD3Family.load(sd35_dir)
        family.transformer.requires_grad_(True)
        if fuse:
            assert attention.fuse_qkv_projections(family.transformer) == 3  # 2 joint attentions, 1 image-only
        inputs = _velocity_inputs(family)
        v = family.velocity(family.transformer, *inputs, 4.5)
        v.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in family.transformer.named_parameters() if "attn" in n and "to_" in n}
        results.append((v.detach(), grads))
    (v0, g0), (v1, g1) = results
    torch.testing.assert_close(v1, v0, rtol=0, atol=1e-6)
    assert g0.keys() == g1.keys() and any("to_q" in n for n in g0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7)


def test_fused_qkv_uses_one_matmul_per_stream_and_leaves_adapted_streams_unfused(sd35_dir, monkeypatch):
    family = SD3Family.load(sd35_dir)
    attention.fuse_qkv_projections(family.transformer)
    inputs = _velocity_inputs(family)
    fused, linear = [], torch.nn.functional.linear

    def spy(x, w, b=None):
        if w.shape[0] == 3 * 16:  # a fused weight [3·inner, width] (no layer of this model has 48 outputs)
            fused.append(w.shape)
        return linear(x, w, b)

    monkeypatch.setattr(attention.F, "linear", spy)
    with torch.no_grad():
        plain = family.velocity(family.transformer, *inputs, 4.5)
    assert len(fused) == 5  # 2 blocks × (image + text stream) + the dual block's image-only attention
    # An engine hosting a trainer's adapter on q/k/v: those streams run their layers one by one, with the adapter.
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=list(SD3Family.lora_target_modules))
    unfused = SD3Family.load(sd35_dir)
    for f in (family, unfused):
        add_lora(f.transformer, spec)
    reference_params = dict(unfused.transformer.named_parameters())
    with torch.no_grad():
        for name, p in family.transformer.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
                reference_params[name].copy_(p)
    fused.clear()
    streams = attention.fused_qkv_streams(family.transformer)
    # SD3's targets are `attn.*`: the dual block's image-only `attn2` keeps plain layers and stays fused.
    assert streams == {"transformer_blocks.0.attn.to_qkv": False, "transformer_blocks.0.attn.add_qkv": False,
                       "transformer_blocks.0.attn2.to_qkv": True, "transformer_blocks.1.attn.to_qkv": False,
                       "transformer_blocks.1.attn.add_qkv": False}
    with torch.no_grad():
        adapted, reference = (f.velocity(f.transformer, *inputs, 4.5) for f in (family, unfused))
    assert len(fused) == 1 and (adapted - plain).abs().max() > 1e-3
    torch.testing.assert_close(adapted, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("targets", [(), ("attn.to_out.0", "attn.to_add_out")], ids=["sd3-targets", "out-projections"])
def test_fused_qkv_trains_with_lora_and_stays_on_policy(sd35_dir, tmp_path, targets):
    """With SD3's own targets the unadapted image-only attention fuses; with LoRA on the output projections only,
    every stream does. Rollout and replay run the same forward: the first pass is exact."""
    cfg = tiny_config(sd35_dir, tmp_path / "run", diffusion_model_family="sd3", use_lora=True, fuse_qkv=True,
                      lora_target_modules=targets, diffusion_guidance_scale=4.5)
    trainer = Trainer(cfg)
    streams = attention.fused_qkv_streams(trainer.policy.transformer)
    assert sum(streams.values()) == (1 if not targets else 5)
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["train/grad_norm"] > 0


# ---------------------------------------------------------------------------------------------- conditioning rows
def test_pairs_index_one_row_per_request_conditioning():
    """Samples of one request hold views of its conditioning: one row each, gathered back bit for bit."""
    from diffrl.train.objectives import conditioning_rows

    requests = [torch.randn(1, 5, 4), torch.randn(1, 5, 4)]
    per_sample = [requests[0][0], requests[0][0], requests[1][0], requests[0][0][:], torch.randn(5, 4)]
    rows, index = conditioning_rows(per_sample, "cpu")
    assert rows.shape == (3, 5, 4) and [int(i) for i in index] == [0, 0, 1, 0, 2]
    assert torch.equal(rows[torch.stack(index)], torch.stack(per_sample))
