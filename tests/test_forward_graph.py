"""`EngineConfig.forward_graph`: an in-process engine whose trainer replays its steps samples in the trainer's
graph (gradients on for the trained parameters, outputs detached), so that compiled blocks run one graph for the
rollout and its replay. Eager, both graphs give the same numbers; the graph with gradients must leave nothing
behind (no parameter gradient, no autograd graph on what the engine returns)."""

import pytest
import torch

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.models.base import repeated_blocks
from diffrl.models.compile import cached_graphs
from diffrl.models.lora import LoraSpec, add_lora
from diffrl.train.trainer import Trainer
from test_compile import needs_compiler
from test_trainer import tiny_config

REQUEST = dict(prompt="a red circle", seed=5, num_outputs_per_prompt=3, num_inference_steps=3, guidance_scale=2.0,
               rollout=True, rollout_sde_step_indices=[0, 1], rollout_return_dit_trajectory=True)


def test_the_training_graph_samples_what_the_inference_graph_does_and_leaves_no_graph(tiny_family):
    family = tiny_family
    add_lora(family.transformer, LoraSpec(rank=4, alpha=4.0, target_modules=list(family.lora_target_modules)))
    lora = [p for n, p in family.transformer.named_parameters() if "lora_" in n]
    for p in lora:
        p.requires_grad_(True)
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)  # a trained adapter: its path changes the velocity
    grad_modes = []
    block = repeated_blocks(family.transformer, family.block_lists)[0]
    block.register_forward_pre_hook(lambda module, args: grad_modes.append(torch.is_grad_enabled()))

    outputs = {}
    for graph in ("inference", "training"):
        grad_modes.clear()
        outputs[graph] = Engine(family, EngineConfig(forward_graph=graph)).generate(RolloutRequest(**REQUEST))
        assert set(grad_modes) == {graph == "training"}  # the blocks ran in the graph asked for
    assert all(p.grad is None for p in lora)
    for a, b in zip(outputs["inference"], outputs["training"], strict=True):
        assert torch.equal(a.rollout_log_probs, b.rollout_log_probs)
        assert torch.equal(a.dit_trajectory.latents, b.dit_trajectory.latents)
        assert torch.equal(a.generated_output, b.generated_output)
        assert b.dit_trajectory.latents.grad_fn is None and not b.rollout_log_probs.requires_grad


def test_an_unknown_forward_graph_is_refused(tiny_family):
    with pytest.raises(ValueError, match="forward_graph 'train'"):
        Engine(tiny_family, EngineConfig(forward_graph="train"))


@pytest.mark.parametrize(("flags", "want"), [
    (dict(compile=True, gradient_checkpointing=True), "training"),  # Flow-GRPO replays its steps
    (dict(compile=True, gradient_checkpointing=True, loss_type="nft"), "inference"),  # no ratio to the rollout
    (dict(compile=False, gradient_checkpointing=True), "inference"),  # eager: one set of numbers either way
    (dict(compile=True, gradient_checkpointing=False), "training"),  # a micro-batch's activations at a time
    (dict(compile=True, gradient_checkpointing=True, gradient_checkpointing_keeps="matmuls"), "training"),
    (dict(compile=True, gradient_checkpointing=True, gradient_checkpointing_interval=2), "training"),
    (dict(compile=True, gradient_checkpointing=True, torchrun=True), "inference"),  # not the in-process trainer's
    (dict(compile=False, engine_forward_graph="training"), "training"),  # asked for
    (dict(compile=True, gradient_checkpointing=True, engine_forward_graph="inference"), "inference"),
])
def test_the_in_process_engine_picks_its_graph(tiny_model_dir, tmp_path, flags, want):
    if flags.pop("torchrun", False):  # several processes: each rank's engine is a copy, not the trained module
        from diffrl.train.policy import in_process_forward_graph

        assert in_process_forward_graph(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=True, **flags),
                                        several_processes=True) == want
        return
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=True, micro_batch_size=2, **flags))
    assert trainer.engine.config.forward_graph == want
    # Without checkpointing a forward with gradients keeps its activations: the trainer's micro-batch at a time.
    # Only blocks that all keep their inputs alone let the whole batch run with gradients on in little memory.
    fully = (flags.get("gradient_checkpointing") and flags.get("gradient_checkpointing_interval", 1) == 1
             and flags.get("gradient_checkpointing_keeps", "inputs") == "inputs")
    rows = 2 if want == "training" and not fully else None
    assert trainer.engine.config.training_graph_rows == rows


def test_the_training_graph_in_pieces_samples_what_the_whole_batch_does(tiny_family):
    """`training_graph_rows`: the velocity in pieces of the trainer's micro-batch (uneven: 3 outputs in pieces of 2)
    gives every output what the whole batch gives, bit for bit on a CPU, and leaves no graph."""
    family = tiny_family
    pieces = []
    velocity = family.velocity_and_uncond

    def counted(transformer, latents, *args, **kwargs):
        pieces.append(latents.tokens.shape[0])
        return velocity(transformer, latents, *args, **kwargs)

    outputs = {}
    for rows in (None, 2):
        pieces.clear()
        family.velocity_and_uncond = counted
        try:
            engine = Engine(family, EngineConfig(forward_graph="training", training_graph_rows=rows))
            outputs[rows] = engine.generate(RolloutRequest(**REQUEST))
        finally:
            del family.velocity_and_uncond
        assert pieces == [3] * 3 if rows is None else pieces == [2, 1] * 3  # 3 steps
    for a, b in zip(outputs[None], outputs[2], strict=True):
        assert torch.equal(a.rollout_log_probs, b.rollout_log_probs)
        assert torch.equal(a.generated_output, b.generated_output)
    with pytest.raises(ValueError, match="training_graph_rows must be >= 1"):
        Engine(family, EngineConfig(forward_graph="training", training_graph_rows=0))


def test_a_flow_grpo_run_sampling_in_the_training_graph_replays_its_rollout_exactly(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", use_lora=True, gradient_checkpointing=True,
                      engine_forward_graph="training", num_steps_per_rollout=1, global_batch_size=6)
    trainer = Trainer(cfg)
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["train/first_pass_clipfrac"] == 0.0
    assert record["train/grad_norm"] > 0


def _graphs_per_kind(family) -> dict[str, int]:
    return {kind: sum(counts) for kind, counts in cached_graphs(family).items()}


@pytest.mark.parametrize("graph", ["training", pytest.param("inference", marks=pytest.mark.slow)])
@needs_compiler
def test_compiled_rollout_and_replay_share_their_graphs_only_in_the_training_graph(tiny_model_dir, tmp_path, graph):
    """Compiled with `--engine-forward-graph training`, the blocks are compiled for every batch size from the first
    call and the engine samples with gradients on: the trainer's replay, at another batch size, runs the graphs the
    rollout compiled and compiles none of its own. Sampling without gradients, the replay compiles its own (the
    graphs whose kernels drift apart on a GPU)."""
    torch._dynamo.reset()
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=True, compile=True,
                                  gradient_checkpointing=True, engine_forward_graph=graph, num_steps_per_rollout=1,
                                  global_batch_size=6, micro_batch_size=4))
    family, update = trainer.policy.family, trainer.update
    after_rollout = {}

    def counted_update(*args, **kwargs):
        after_rollout.update(_graphs_per_kind(family))
        return update(*args, **kwargs)

    trainer.update = counted_update
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and after_rollout
    if graph == "training":
        assert _graphs_per_kind(family) == after_rollout
    else:
        assert all(_graphs_per_kind(family)[kind] > n for kind, n in after_rollout.items())


def test_every_compiled_gpu_recipe_that_replays_its_rollout_samples_in_the_training_graph():
    """A GPU recipe that compiles and whose loss compares the trainer's log-prob with the rollout's must resolve
    --engine-forward-graph auto to the trainer's graph: otherwise its first pass clips on compiler rounding."""
    from diffrl.train.objectives import OBJECTIVES
    from diffrl.recipes import recipe_config, recipe_names
    from diffrl.train.policy import in_process_forward_graph

    compiled = {}
    for name in recipe_names():
        cfg = recipe_config(name, "cuda")
        if cfg.model.compile and OBJECTIVES[cfg.algorithm.loss_type].replays_rollout_steps:
            compiled[name] = in_process_forward_graph(cfg, several_processes=False)
    assert {"sd3-grpo", "sd35-grpo-pickscore", "flux3-klein-grpo-hps"} <= set(compiled)
    assert {name for name, graph in compiled.items() if graph != "training"} == set()


@pytest.mark.slow  # inductor on 2 cores; the uncompiled mechanism is in the default run above
@needs_compiler
@pytest.mark.parametrize("flags", [dict(gradient_checkpointing=True, gradient_checkpointing_keeps="matmuls"),
                                   dict(gradient_checkpointing=False)], ids=["keeps-matmuls", "no-checkpointing"])
def test_a_compiled_run_replays_exactly_when_the_engine_runs_the_training_graph_in_pieces(tiny_model_dir, tmp_path,
                                                                                       flags):
    """Compiled, with blocks that keep more than their inputs (selective checkpointing, or none), the engine samples
    in the training graph in pieces of the micro-batch, and the first pass replays the rollout exactly."""
    torch._dynamo.reset()
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=True, compile=True,
                                  num_steps_per_rollout=1, global_batch_size=6, micro_batch_size=4, **flags))
    assert (trainer.engine.config.forward_graph, trainer.engine.config.training_graph_rows) == ("training", 4)
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["train/first_pass_clipfrac"] == 0.0
    assert record["train/grad_norm"] > 0


def test_micro_batch_bounds_cut_at_size_and_where_the_key_changes():
    from diffrl.algorithms.pairs import micro_batch_bounds

    assert micro_batch_bounds(None, 4, 10) == [(0, 4), (4, 8), (8, 10)]
    keys = torch.tensor([0.9, 0.9, 0.9, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.5])
    assert micro_batch_bounds(keys, 4) == [(0, 3), (3, 7), (7, 9), (9, 10)]
    assert micro_batch_bounds(torch.tensor([0.5]), 4) == [(0, 1)]


def test_flow_grpo_micro_batches_hold_one_trained_step_and_every_pair_once(tiny_model_dir, tmp_path):
    """Each micro-batch the trainer hands Flow-GRPO's loss holds one σ (the rollout's per-step path through per-row
    timestep layers: the same graphs as the rollout), every pair of the optimizer step is in exactly one of them, and
    the loss passes σ on as one value (stride 0)."""
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=True, num_steps_per_rollout=1,
                                  global_batch_size=6, micro_batch_size=4))
    seen, loss, velocity = [], trainer.objective.loss, trainer.objective._velocity
    strides = []

    def recording_loss(batch, env, step):
        seen.append(batch.sigma.clone())
        return loss(batch, env, step)

    def recording_velocity(x, sigma, *args):
        strides.append(sigma.stride(0))
        return velocity(x, sigma, *args)

    trainer.objective.loss, trainer.objective._velocity = recording_loss, recording_velocity
    trainer.rollout_and_update(0)
    window = trainer.objective.window
    assert len(window) > 1 and all(len(s.unique()) == 1 and len(s) <= 4 for s in seen)
    assert sum(len(s) for s in seen) == 6 * len(window)  # 6 samples × the trained steps, each pair once
    assert strides and set(strides) == {0}


def test_flow_grpo_optimizer_steps_take_whole_samples(tiny_model_dir, tmp_path):
    """Two optimizer steps per rollout split the samples, each sample with all its trained steps (flow_grpo's and
    miles-diffusion's split), so each step holds the same number of pairs at every σ and its one-step micro-batches
    come out whole; every pair is trained once."""
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=True, num_steps_per_rollout=2,
                                  global_batch_size=3, micro_batch_size=3))
    built, seen = {}, []
    make_pairs, loss = trainer.objective.pairs, trainer.objective.loss

    def recording_pairs(*args, **kwargs):
        built["pairs"] = make_pairs(*args, **kwargs)
        return built["pairs"]

    def recording_loss(batch, env, step):
        seen.append((step, batch.old_log_prob.clone(), batch.sigma.clone()))
        return loss(batch, env, step)

    trainer.objective.pairs, trainer.objective.loss = recording_pairs, recording_loss
    trainer.rollout_and_update(0)
    pairs, steps_per_sample = built["pairs"], len(trainer.objective.window)
    assert steps_per_sample > 1 and trainer.objective.pairs_per_sample(pairs) == steps_per_sample
    # Each pair's old log-prob names it (continuous values): which sample it came from, which step trained it.
    index = {float(v): i for i, v in enumerate(pairs.old_log_prob)}
    assert len(index) == len(pairs)
    step_of_pair = {index[float(v)]: step for step, values, _ in seen for v in values}
    assert sorted(step_of_pair) == list(range(len(pairs)))  # every pair once
    for sample in range(len(pairs) // steps_per_sample):
        pair_steps = {step_of_pair[sample * steps_per_sample + j] for j in range(steps_per_sample)}
        assert len(pair_steps) == 1  # a sample's pairs are trained in one optimizer step
    for step in (0, 1):
        counts = torch.cat([s for st, _, s in seen if st == step]).unique(return_counts=True)[1]
        assert len(set(counts.tolist())) == 1 and int(counts[0]) == 3  # 3 samples a step, at every σ
    assert all(len(s) == 3 for _, _, s in seen)  # micro-batches of 3 pairs: none cut short
