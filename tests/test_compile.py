"""Regional compilation (`--compile`): the blocks the engine and the trainer share are compiled, and a
rollout and update through them matches the eager ones to rounding."""

import importlib
import shutil
from types import SimpleNamespace

import pytest
import torch

from diffrl.models.base import FamilyAdapter, repeated_blocks
from diffrl.models.compile import block_kinds_at_recompile_limit, compile_blocks, uncompiled_block_kinds
from diffrl.utils.compile_settings import compile_settings
from diffrl.train.trainer import Trainer
from family_checks import run_training
from test_trainer import tiny_config

needs_compiler = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")),
                                    reason="inductor needs a C compiler on CPU")


@needs_compiler
def test_compiled_rollout_and_update_match_eager(tiny_model_dir, tmp_path):
    results = []
    for flag in (False, True):
        torch._dynamo.reset()
        trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / f"run-{flag}", compile=flag, use_lora=True,
                                      num_steps_per_rollout=1, global_batch_size=6))
        blocks = repeated_blocks(trainer.policy.family.transformer, trainer.policy.family.block_lists)
        assert blocks and all((b._compiled_call_impl is not None) is flag for b in blocks)
        assert trainer.engine.family is trainer.policy.family  # one compiled module serves both
        record = trainer.rollout_and_update(0)
        # Checked once every block has run: compiled, none of them ran eager; without --compile, not checked.
        assert record.get("compile/uncompiled_block_kinds") == (0.0 if flag else None)
        assert record.get("compile/block_kinds_at_recompile_limit") == (0.0 if flag else None)
        results.append((record, [p.detach().clone() for p in trainer.policy.params]))
    (eager, params_eager), (compiled, params_compiled) = results
    # The rollout used the compiled blocks and the trainer replayed it through them: the first pass agrees.
    assert compiled["train/log_prob_mean_abs_diff"] < 1e-4
    assert compiled["rollout/reward/raw_mean"] == pytest.approx(eager["rollout/reward/raw_mean"], abs=1e-4)
    assert compiled["train/loss"] == pytest.approx(eager["train/loss"], abs=1e-4)
    for a, b in zip(params_eager, params_compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_blocks_that_dynamo_skipped_are_named():
    """A compiled block first called under a dispatch mode (here torch's FLOP counter) is skipped by dynamo for
    good and runs eager: `uncompiled_block_kinds` names its class once the blocks have run; a kind that compiled,
    and blocks never compiled, are not named."""
    from torch.utils.flop_counter import FlopCounterMode

    class Skipped(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class Compiled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1

    class Plain(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) - 1

    torch._dynamo.reset()
    model = torch.nn.Module()
    model.a = torch.nn.ModuleList([Skipped(4, 4), Skipped(4, 4)])
    model.b = torch.nn.ModuleList([Compiled(4, 4), Plain(4, 4)])
    for block in [*model.a, model.b[0]]:
        block.compile(backend="eager")  # dynamo's bookkeeping is what is checked: no inductor needed
    x = torch.randn(2, 4)
    with FlopCounterMode(display=False):
        model.a[0](x)
    for block in [*model.a, *model.b]:
        block(x)
    family = SimpleNamespace(transformer=model, block_lists=("a", "b"))
    family.compiled_units = lambda: FamilyAdapter.compiled_units(family)
    assert uncompiled_block_kinds(family) == ["Skipped"]


@pytest.fixture
def recompile_limit_of_two(monkeypatch):
    """dynamo's recompile limit at 2 where compiled blocks run (`compile_settings`), for one test."""
    from diffrl.utils import compile_settings

    settings = {k: dict(v) for k, v in compile_settings._SETTINGS.items()}
    settings["dynamo"]["recompile_limit"] = 2
    monkeypatch.setattr(compile_settings, "_SETTINGS", settings)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_block_kinds_with_a_full_dynamo_cache_are_named(recompile_limit_of_two):
    """Past dynamo's recompile limit a block runs eager for any call no cached graph accepts: the kind whose cache
    is full is named, a kind with room is not."""
    class Recompiling(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class Steady(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Recompiling(4, 4), Steady(4, 4)])
    for block in model.blocks:
        block.compile(backend="eager", dynamic=False)  # a graph per shape: dynamo's bookkeeping is what is checked
    family = SimpleNamespace(transformer=model, block_lists=("blocks",))
    family.compiled_units = lambda: FamilyAdapter.compiled_units(family)
    with compile_settings():  # where blocks run: inside every transformer call
        model.blocks[1](torch.randn(2, 4))
        model.blocks[0](torch.randn(2, 4))
        assert block_kinds_at_recompile_limit(family) == []
        for rows in (3, 5):  # a second graph fills the cache; the third shape runs eager
            model.blocks[0](torch.randn(rows, 4))
    assert block_kinds_at_recompile_limit(family) == ["Recompiling"]


def test_nothing_to_compile_is_an_error():
    with pytest.raises(ValueError, match="no blocks to compile"):
        compile_blocks(torch.nn.Module(), [])


@needs_compiler
def test_served_engine_compiles_and_hosts_a_lora_adapter_afterwards(tiny_model_dir):
    """`diffrl serve --compile`: the engine's images match an eager engine's, also after a LoRA adapter
    is hosted on the compiled blocks (peft replaces layers inside them; they recompile)."""
    from diffrl.engine.protocol import RolloutRequest
    from diffrl.serving.server import ServeConfig, build_engine
    from diffrl.models.lora import LoraSpec

    torch._dynamo.reset()
    engines = [build_engine(ServeConfig(model_path=tiny_model_dir, device="cpu", compile=flag)) for flag in (False, True)]
    blocks = repeated_blocks(engines[1].family.transformer, engines[1].family.block_lists)
    assert all(b._compiled_call_impl is not None for b in blocks)
    request = RolloutRequest(prompt="a red circle", seed=3, num_outputs_per_prompt=2, num_inference_steps=2)

    def images(engine):
        return torch.stack([o.generated_output for o in engine.generate(request)])

    torch.testing.assert_close(images(engines[1]), images(engines[0]), rtol=0, atol=1e-4)
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=list(engines[0].family.lora_target_modules))
    for engine in engines:
        assert engine.add_lora_adapter(spec)
    eager, compiled = (dict(e.family.transformer.named_parameters()) for e in engines)
    with torch.no_grad():
        for name, p in compiled.items():
            if "lora_" in name:
                p.normal_(0, 0.5)
                eager[name].copy_(p)
    adapted = images(engines[0])
    assert not torch.allclose(adapted, images(build_engine(ServeConfig(model_path=tiny_model_dir, device="cpu"))))
    torch.testing.assert_close(images(engines[1]), adapted, rtol=0, atol=1e-4)


# Each family's Flow-GRPO settings as its own training test runs them: CFG scale, video size, rollout step kind.
FAMILY_RUNS = {
    "sd3": (4.5, None, ()), "flux3_image": (2.0, None, ()), "qwen_image": (4.0, None, ()), "krea2": (2.0, None, ()),
    "chroma": (2.0, None, ()), "sana": (2.0, None, ()), "lumina2": (2.0, None, ()), "cogview4": (2.0, None, ()),
    "hidream": (2.0, None, ()),
    "wan2_2": (4.5, dict(resolution=16, num_frames=5, diffusion_guidance_scale_2=2.0), ()),
    "cosmos3": (4.0, dict(resolution=16, num_frames=5), ()),
    "ltx2": (1.0, dict(height=64, width=96, num_frames=9),
             ("--diffusion-sde-type", "cps", "--diffusion-noise-level", "0.8")),
}


@pytest.mark.slow  # ~1 minute of inductor per family on 2 cores; the demo family's compiled run is in the default run
@needs_compiler
@pytest.mark.parametrize("family", sorted(FAMILY_RUNS))
def test_every_family_trains_compiled(family, tmp_path):
    """`diffrl train --compile` (LoRA Flow-GRPO) on each family's tiny checkpoint: every kind of block compiled,
    the trainer's compiled replay matches the engine's log-probs, and the checkpoint loads back (run_training)."""
    torch._dynamo.reset()
    save = importlib.import_module(f"diffrl.models.random_checkpoints.{family}").save_random_checkpoint
    guidance, video, flags = FAMILY_RUNS[family]
    records = run_training(save(tmp_path / f"{family}-tiny"), tmp_path / "run", "flow_grpo", True, guidance,
                           video=video, extra_flags=("--compile", *flags))
    assert [r["compile/uncompiled_block_kinds"] for r in records if "train/loss" in r] == [0.0]


def test_compile_settings_reach_the_threads_that_run_compiled_blocks(monkeypatch):
    """torch keeps compiler settings per thread; engines run forwards in worker threads. What `compile_blocks`
    needs (eager's bf16 roundings, a larger recompile limit) holds in any thread inside `compile_settings`, the
    context of every transformer call, and is absent outside it there."""
    import threading

    import torch._inductor.config as inductor

    from diffrl.utils import compile_settings as settings_module

    monkeypatch.setattr(settings_module, "_SETTINGS", {"dynamo": {}, "inductor": {}})
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    compile_blocks(model, ["blocks"], eager_numerics=True)
    seen = {}

    def engine_thread():
        seen["outside"] = inductor.emulate_precision_casts
        with compile_settings():
            seen["inside"] = (inductor.emulate_precision_casts, torch._dynamo.config.recompile_limit)

    worker = threading.Thread(target=engine_thread)
    worker.start()
    worker.join()
    assert seen == {"outside": False, "inside": (True, 64)}


@pytest.mark.slow  # two compiled runs' worth of inductor on 2 cores (~1 minute)
@needs_compiler
def test_compiled_bf16_replay_matches_the_engine_exactly(tmp_path):
    """SD3 at bf16 autocast, compiled: the engine (a worker thread) and the trainer (the main thread) compile their
    graphs with the same settings, so the first pass replays the rollout's log-probs exactly. Before the settings
    reached the engine's thread this run drifted by 5.8e-5 and clipped 14% of its pairs."""
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint

    torch._dynamo.reset()
    records = run_training(save_random_checkpoint(tmp_path / "sd3-tiny"), tmp_path / "run", "flow_grpo", True, 4.5,
                           extra_flags=("--compile", "--mixed-precision", "bf16"))
    first = next(r for r in records if "train/loss" in r)
    assert first["compile/uncompiled_block_kinds"] == 0.0
    assert first["train/log_prob_mean_abs_diff"] == 0.0 and first["train/clipfrac"] == 0.0
