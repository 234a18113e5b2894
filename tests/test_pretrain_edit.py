"""`diffrl pretrain --world shapes-edit`: the editing demo model's pretraining (docs/editing-world.md)."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

from diffrl.cli.main import main as cli_main
from diffrl.data.scenes import RenderedEdits
from diffrl.data.shapes.edits import parse_edit, verify_edit
from diffrl.models.demo import SHIPPED_DEMO_MODEL, SHIPPED_EDIT_MODEL, DemoFamily
from diffrl.models.random_checkpoints.demo import EDIT_VERBS, random_family, tiny
from diffrl.train.pretrain import adapt_for_editing, condition_on_sources, model_world, refuse_other_world


def test_a_tiny_editing_model_pretrains_and_samples_with_a_source(tmp_path):
    from diffrl.evaluation.shapes_edit import evaluate_edits

    out = tmp_path / "run"
    assert cli_main(["pretrain", "--world", "shapes-edit", "--output-dir", str(out), "--steps", "2",
                     "--batch-size", "4", "--num-workers", "0", "--log-every", "1", "--sample-steps", "1",
                     "--sample-guidance-scale", "1", "--sample-edits-per-kind", "1",
                     "--device", "cpu", "--num-attention-heads", "2", "--attention-head-dim", "8", "--num-layers", "1",
                     "--num-single-layers", "1", "--text-d-model", "16"]) == 0
    model = DemoFamily.load(out / "final")
    assert model_world(model) == "shapes-edit"
    # The last checkpoint's grid of held-out edits, and their strict scores in metrics.jsonl.
    assert (out / "samples" / "step-0000002.png").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/strict" in r] == [2]
    # It samples with a condition image, and the source changes what it draws.
    metrics = evaluate_edits(model, tmp_path / "eval", per_kind=1, num_steps=1, guidance_scale=1.0)
    assert set(metrics) >= {"eval/strict", "eval/score", "eval/strict/move"}
    example = next(iter(RenderedEdits(seed=0)))
    _, target, source = example
    cond = model.encode_prompts([example[0]])
    latents = model.prepare_latents([torch.Generator().manual_seed(0)], 64, 64)
    sigma = torch.tensor([0.5])
    with torch.no_grad():
        v = [model.velocity(model.transformer, latents, sigma, condition_on_sources(model, cond, image[None]), None,
                            1.0) for image in (source, target)]
    assert not torch.equal(v[0], v[1])


def test_the_batch_carries_source_instruction_and_its_verified_target():
    family = random_family(tiny(), world="shapes-edit", batch_invariant=False)
    loader = DataLoader(RenderedEdits(seed=3), batch_size=3)
    instructions, targets, sources = next(iter(loader))
    for instruction, target, source in zip(instructions, targets, sources):
        parse_edit(instruction)
        verdict = verify_edit(source.permute(1, 2, 0).numpy(), target.permute(1, 2, 0).numpy(), instruction)
        assert verdict.strict, (instruction, verdict.reason)
        assert not torch.equal(source, target)
    # The batch's conditioning is the engine's, row by row: each row's text, then its own source's tokens.
    cond = family.encode_prompts(instructions)
    batch = condition_on_sources(family, cond, sources)
    for i, source in enumerate(sources):
        row = family.condition_on_images(family.encode_prompts([instructions[i]]),
                                         family.encode_condition_images([source]))
        torch.testing.assert_close(batch.embeds[i:i + 1], row.embeds, rtol=0, atol=0)
        assert torch.equal(batch.ids, row.ids)


def test_a_shapes_model_is_made_ready_for_editing(tmp_path):
    family = DemoFamily.load(SHIPPED_DEMO_MODEL, batch_invariant=False)
    assert model_world(family) == "shapes"
    state = {k: v.clone() for k, v in family.transformer.state_dict().items()}
    # The shipped text-to-image model never ran its reference mode: its RMSNorm scales there are still ones.
    assert all((v == 1).all() for k, v in state.items() if ".image_cond." in k and "norm" in k)
    old_ids = family.tokenize(["a red circle above a blue square"])[0]
    old_embedding = family.text_encoder.get_input_embeddings().weight.detach().clone()
    adapt_for_editing(family)
    assert model_world(family) == "shapes-edit"
    assert torch.equal(family.tokenize(["a red circle above a blue square"])[0], old_ids)
    embedding = family.text_encoder.get_input_embeddings().weight
    assert torch.equal(embedding[:len(old_embedding)], old_embedding)
    unk = old_embedding[family.tokenizer.unk_token_id]
    verbs = family.tokenizer.convert_tokens_to_ids(list(EDIT_VERBS))
    assert all(torch.equal(embedding[i], unk) for i in verbs)
    new = family.transformer.state_dict()
    copied = [k for k in new if ".image_cond." in k]
    assert copied and all(torch.equal(new[k], state[k.replace(".image_cond.", ".image.", 1)]) for k in copied)
    assert all(torch.equal(new[k], state[k]) for k in new if ".image_cond." not in k)
    # An editing model starts an editing pretraining as it is, and is refused as a text-to-image one.
    refuse_other_world("shapes-edit", family, "--init-from X")
    with pytest.raises(ValueError, match="pass --world shapes-edit"):
        refuse_other_world("shapes", family, "--init-from X")


@pytest.mark.parametrize("name", ["shapes-edit-nft", "shapes-edit-grpo"])
def test_edit_recipes_train_the_editing_model(name):
    from diffrl.recipes import recipe_config

    for device in ("cpu", "cuda"):
        cfg = recipe_config(name, device)
        cfg.check()
        assert (cfg.model.model_path, cfg.task.world, cfg.task.reward) == (SHIPPED_EDIT_MODEL, "shapes-edit",
                                                                           "shapes_edit")


def test_the_shipped_editing_model_is_an_editing_model_that_edits(tmp_path):
    """diffrl/assets/demo-shapes-edit (pretrained on a GPU, docs/editing-world.md): its tokenizer has the edit verbs,
    `--world shapes` refuses it, and it passes most of a few held-out edits at CFG 1 (on 64 of each kind: 0.707
    strict; the shipped text-to-image model, adapted but not trained, passes none)."""
    from diffrl.evaluation.shapes_edit import evaluate_edits

    model = DemoFamily.load(SHIPPED_EDIT_MODEL)
    assert model_world(model) == "shapes-edit"
    with pytest.raises(ValueError, match="--world shapes: .* is a model of the shapes-edit world"):
        refuse_other_world("shapes", model, "the shipped editing model")
    metrics = evaluate_edits(model, tmp_path, per_kind=2, num_steps=10, guidance_scale=1.0)
    assert metrics["eval/strict"] >= 0.5
