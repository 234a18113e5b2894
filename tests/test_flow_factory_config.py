"""`diffrl train --flow-factory-config FILE.yaml`: a run file in Flow-Factory's layout (its sections and key names,
written here for the test) becomes diffrl's settings; flags given after it win; every key is translated, accepted
with its reason, or refused by name."""

import pytest

from diffrl.cli.flow_factory_config import translate_file
from diffrl.cli.main import parse

RUN = """
launcher: "accelerate"
num_processes: 8
mixed_precision: "bf16"
data:
  dataset_dir: "{data}"
  dataloader_num_workers: 16
model:
  finetune_type: 'lora'
  lora_rank: 64
  lora_alpha: 128
  target_modules: "default"
  model_name_or_path: "{model}"
  model_type: "z-image"
  resume_path: null
log:
  logging_backend: "tensorboard"
  save_dir: "{out}"
  save_freq: 20
train:
  trainer_type: 'nft'
  advantage_aggregation: 'sum'
  adv_clip_range: [-5.0, 5.0]
  kl_type: 'v-based'
  kl_beta: 0
  resolution: [384, 512]
  num_inference_steps: 8
  guidance_scale: 1.0
  per_device_batch_size: 2
  group_size: 16
  global_std: false
  unique_sample_num_per_epoch: 48
  gradient_step_per_epoch: 2
  learning_rate: 1.0e-4
  adam_weight_decay: 1.0e-4
  adam_betas: [0.9, 0.999]
  max_grad_norm: 1.0
  ema_decay: 0.9
  ema_update_interval: 4
  enable_gradient_checkpointing: true
  seed: 42
  num_train_timesteps: 2
  time_sampling_strategy: logit_normal
  time_shift: 3.0
  timestep_range: 0.5
scheduler:
  dynamics_type: "ODE"
  seed: 7
eval:
  resolution: 1024
  num_inference_steps: 28
  guidance_scale: 4.0
  eval_freq: 20
rewards:
  - name: "pick_score"
    reward_model: "PickScore"
    weight: 1
"""


@pytest.fixture
def run_file(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "a cat"}\n')
    (data / "test.jsonl").write_text('{"prompt": "a dog"}\n')
    path = tmp_path / "nft.yaml"
    path.write_text(RUN.format(data=data, model=tmp_path / "z-image", out=tmp_path / "run"))
    return path


def test_the_run_file_becomes_diffrls_settings(run_file, tmp_path):
    config = parse(["train", "--flow-factory-config", str(run_file), "--reward", "jpeg_compressibility",
                    "--lr", "2e-4"])
    m, a, r, o, e = config.model, config.algorithm, config.rollout, config.optim, config.eval
    assert (m.use_lora, m.lora_rank, m.lora_alpha, m.height, m.width, m.mixed_precision) == (True, 64, 128.0, 384,
                                                                                             512, "bf16")
    assert str(m.model_path) == str(tmp_path / "z-image") and m.gradient_checkpointing
    assert (a.loss_type, a.diffusion_adv_clip_max, a.kl_type, a.diffusion_kl_beta) == ("nft", 5.0, "v-based", 0.0)
    assert (a.train_timesteps, a.train_timestep_sampling, a.train_timestep_shift, a.train_timestep_range) == (
        2, "logit_normal", 3.0, (0.0, 0.5))
    assert (a.use_ema, a.ema_decay, a.ema_update_interval) == (True, 0.9, 8)  # 4 rollouts of 2 optimizer steps
    assert (r.n_samples_per_prompt, r.rollout_batch_size, o.num_steps_per_rollout, o.global_batch_size) == (16, 48, 2,
                                                                                                           384)
    assert (r.diffusion_num_steps, r.diffusion_guidance_scale, o.micro_batch_size, o.weight_decay, o.grad_clip) == (
        8, 1.0, 2, 1e-4, 1.0)
    assert o.lr == 2e-4  # the flag given after the file wins over its 1e-4
    assert (config.seed, r.rollout_seed, e.eval_resolution, e.eval_num_steps, e.eval_guidance_scale,
            e.eval_interval) == (42, 7, 1024, 28, 4.0, 20)
    assert str(config.task.prompt_data).endswith("train.jsonl") and str(config.task.eval_prompt_data).endswith(
        "test.jsonl")
    assert config.checkpoint.checkpoint_interval == 20 and str(config.checkpoint.output_dir) == str(tmp_path / "run")


def test_rewards_need_local_models_and_unknown_keys_are_refused(run_file, tmp_path):
    with pytest.raises(ValueError, match="names its rewards by hub name; pass --reward"):
        parse(["train", "--flow-factory-config", str(run_file)])
    bad = tmp_path / "bad.yaml"
    swan = tmp_path / "swan.yaml"
    swan.write_text("log:\n  logging_backend: swanlab\n  project: P\n  run_name: R\n")
    assert translate_file(swan).args == ["--use-swanlab", "--swanlab-project", "P", "--swanlab-run-name", "R"]
    bad.write_text("train:\n  trainer_type: grpo\n  mystery_knob: 3\n")
    with pytest.raises(ValueError, match=r"no diffrl setting for train.mystery_knob"):
        translate_file(bad)
    bad.write_text("train:\n  adv_clip_range: [-2.0, 5.0]\n")
    with pytest.raises(ValueError, match="clips advantages symmetrically"):
        translate_file(bad)


def test_a_grpo_file_maps_its_sde_window(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("train:\n  trainer_type: grpo\n  clip_range: 1.0e-4\nscheduler:\n  dynamics_type: Flow-SDE\n"
                    "  noise_level: 0.7\n  num_sde_steps: 1\n  sde_steps: [1, 2, 3]\n")
    out = translate_file(path)
    assert out.args == ["--loss-type", "flow_grpo", "--diffusion-clip-range", "0.0001", "--diffusion-sde-type", "sde",
                        "--diffusion-noise-level", "0.7", "--diffusion-num-sde-steps", "1",
                        "--diffusion-sde-window-range", "1,4", "--diffusion-sde-step-strategy", "random"]


def test_an_nft_files_sampling_ema_is_diffusion_nfts_old_policy(tmp_path):
    """With `off_policy` the EMA that samples (a piecewise-linear decay: flat steps, ramp, `ema_decay` its maximum) is
    DiffusionNFT's old policy, diffrl's --nft-ema-*; without it NFT samples the current weights: decay 0."""
    path = tmp_path / "nft.yaml"
    path.write_text("train:\n  trainer_type: nft\n  nft_beta: 0.1\n  off_policy: true\n"
                    "  ema_decay_schedule: piecewise_linear\n  flat_steps: 0\n  ramp_rate: 0.001\n  ema_decay: 0.5\n"
                    "  ema_update_interval: 1\n  ema_device: cuda\n")
    config = parse(["train", "--flow-factory-config", str(path)])
    a = config.algorithm
    assert (a.loss_type, a.diffusion_nft_beta, a.nft_ema_max, a.nft_ema_flat, a.nft_ema_ramp, a.use_ema) == (
        "nft", 0.1, 0.5, 0, 0.001, False)
    path.write_text("train:\n  trainer_type: nft\n  off_policy: false\n  ema_decay: 0.9\n")
    a = parse(["train", "--flow-factory-config", str(path)]).algorithm
    assert (a.nft_ema_max, a.use_ema, a.ema_decay) == (0.0, True, 0.9)
    path.write_text("train:\n  trainer_type: awm\n  off_policy: true\n")
    with pytest.raises(ValueError, match="train.off_policy with --loss-type awm: diffrl samples the current weights"):
        translate_file(path)


def test_keys_the_method_does_not_read_are_left_out_saying_so(tmp_path):
    """An NFT file may carry GRPO's clip range and SDE settings (Flow-Factory's defaults); diffrl refuses those flags
    under --loss-type nft, so the translation leaves them out with a note, and the file parses."""
    path = tmp_path / "nft.yaml"
    path.write_text("train:\n  trainer_type: nft\n  clip_range: 1.0e-4\nscheduler:\n  noise_level: 0.7\n")
    out = translate_file(path)
    assert "--diffusion-clip-range" not in out.args and "--diffusion-noise-level" not in out.args
    assert "train.clip_range: not read by --loss-type nft" in out.notes
    assert parse(["train", "--flow-factory-config", str(path)]).algorithm.loss_type == "nft"


def test_a_wan_files_flow_shift_and_second_eval_scale_become_flags(tmp_path):
    path = tmp_path / "wan.yaml"
    path.write_text("scheduler:\n  flow_shift: 3.0\neval:\n  guidance_scale: 4.0\n  guidance_scale_2: 3.0\n")
    out = translate_file(path)
    assert out.args == ["--flow-shift", "3.0", "--eval-guidance-scale", "4.0", "--eval-guidance-scale-2", "3.0"]
    cfg = parse(["train", "--flow-factory-config", str(path), "--reward", "jpeg_compressibility"])
    assert (cfg.model.flow_shift, cfg.eval.eval_guidance_scale, cfg.eval.eval_guidance_scale_2) == (3.0, 4.0, 3.0)


def test_a_dgpo_file_gets_the_reference_codes_old_policy_options(tmp_path):
    """Flow-Factory's DGPO clips against an old policy unless told not to, and calls its β dpo_beta."""
    path = tmp_path / "dgpo.yaml"
    path.write_text("train:\n  trainer_type: dgpo\n  dpo_beta: 10\n  clip_range: 5.0e-2\n  use_shared_noise: true\n"
                    "  clip_kl: false\n  kl_cfg: 1.0\n  ema_ref_max_decay: 0.3\n  ema_ref_ramp_rate: 0.001\n"
                    "  ema_ref_device: cuda\n")
    out = translate_file(path)
    assert out.args == ["--dgpo-clip-dsm", "--dgpo-switch-ema-ref", "200", "--dgpo-ema-ref-max-decay", "0.3",
                        "--dgpo-ema-ref-ramp-rate", "0.001", "--loss-type", "dgpo", "--dgpo-beta", "10",
                        "--diffusion-clip-range", "0.05"]
    g = parse(["train", "--flow-factory-config", str(path)]).dgpo
    assert (g.dgpo_beta, g.dgpo_clip_dsm, g.dgpo_switch_ema_ref) == (10.0, True, 200)
    path.write_text("train:\n  trainer_type: dgpo\n  clip_dsm: false\n")
    assert translate_file(path).args == ["--loss-type", "dgpo"]  # no old policy: nothing to switch to
    path.write_text("train:\n  trainer_type: dgpo\n  kl_cfg: 4.5\n")
    assert parse(["train", "--flow-factory-config", str(path)]).algorithm.kl_cfg == 4.5  # a guided reference
    for bad, why in (("use_shared_noise: false", "re-noises a group with one ε"),):
        path.write_text(f"train:\n  trainer_type: dgpo\n  {bad}\n")
        with pytest.raises(ValueError, match=why):
            translate_file(path)


def test_a_crd_files_own_keys_become_its_flags(tmp_path):
    path = tmp_path / "crd.yaml"
    path.write_text("train:\n  trainer_type: crd\n  crd_beta: 2.0\n  crd_loss_type: bce\n"
                    "  old_model_decay: '0-0.25-0.005-0.999'\n  sampling_model_decay: medium\n"
                    "  reward_adaptive_kl: false\n  use_old_for_loss: true\n  adaptive_logp: true\n  weight_temp: -1.0\n")
    out = translate_file(path)
    c = parse(["train", "--flow-factory-config", str(path)]).crd
    assert (c.crd_beta, c.crd_loss, c.crd_reward_adaptive_kl) == (2.0, "bce", False)
    assert c.crd_old_decay == (0.0, 0.25, 0.005, 0.999) and c.crd_sampling_decay == (75.0, 0.0, 0.0075, 0.999)
    assert "--crd-sampling-decay" in out.args
    for bad in ("weight_temp: 0.5", "use_old_for_loss: false", "sampling_model_decay: 'a-b'"):
        path.write_text(f"train:\n  trainer_type: crd\n  {bad}\n")
        with pytest.raises(ValueError, match=bad.split(":")[0]):
            translate_file(path)


def test_awm_and_dpo_files_take_their_methods_keys(tmp_path):
    path = tmp_path / "awm.yaml"
    path.write_text("train:\n  trainer_type: awm\n  awm_weighting: 'ghuber'\n  ghuber_power: 0.25\n  kl_weight: 'Uniform'\n"
                    "  ema_kl_beta: 1\n  ema_decay: 0.3\n  warmup_steps: 1000\n"
                    "  time_sampling_strategy: discrete_wo_init\n")
    w = parse(["train", "--flow-factory-config", str(path)])
    assert (w.awm.awm_weighting, w.awm.awm_ghuber_power, w.awm.awm_ema_kl_beta, w.awm.awm_ema_decay) == (
        "ghuber", 0.25, 1.0, 0.3)
    assert w.algorithm.train_timestep_sampling == "schedule_without_first"
    assert (w.awm.awm_ema_schedule, w.awm.awm_ema_warmup) == ("power", 1000)  # Flow-Factory's default schedule
    path.write_text("train:\n  trainer_type: dpo\n  beta: 100.0\n  weighting_scheme: logit_normal\n  logit_mean: 0.0\n"
                    "  logit_std: 1.0\n")
    d = parse(["train", "--flow-factory-config", str(path)])
    assert (d.dpo.dpo_beta, d.algorithm.train_timestep_sampling, d.algorithm.train_timesteps) == (100.0, "logit_normal", 1)
    path.write_text("train:\n  trainer_type: dpo\n  logit_std: 2.0\n")
    with pytest.raises(ValueError, match="logit_std"):
        translate_file(path)


def test_a_component_default_target_trains_that_component_alone(tmp_path):
    """Wan2.2 I2V's example shards both experts (target_components) but adapts the high-noise one (transformer.default)."""
    path = tmp_path / "wan.yaml"
    path.write_text("model:\n  target_components: ['transformer', 'transformer_2']\n  target_modules: 'transformer.default'\n")
    assert translate_file(path).args == ["--lora-components", "transformer"]


def test_an_ltx2_audio_video_files_guidance_keys_are_what_diffrl_samples_or_refused(tmp_path):
    path = tmp_path / "ltx2.yaml"
    keys = "  frame_rate: 24.0\n  stg_scale: 0.0\n  modality_scale: 1.0\n  guidance_rescale: 0.0\n  audio_stg_scale: null\n"
    path.write_text(f"model:\n  model_type: ltx2_t2av\ntrain:\n{keys}  prompt_enhancement_seed: 10\neval:\n{keys}")
    out = translate_file(path)
    assert out.args == [] and any("returns the video alone" in n for n in out.notes)
    for bad in ("stg_scale: 1.0", "frame_rate: 25.0", "audio_guidance_scale: 3.0"):
        path.write_text(f"train:\n  {bad}\n")
        with pytest.raises(ValueError, match=bad.split(":")[0]):
            translate_file(path)


@pytest.mark.parametrize(("train", "side", "exact"), [("384", 384, True), ("[384, 384]", 384, True),
                                                      ("[512, 288]", 384, True), ("[300, 200]", 245, False)])
def test_an_editing_files_condition_image_sizes_are_the_sides_of_their_areas(tmp_path, train, side, exact):
    path = tmp_path / "edit.yaml"
    path.write_text(f"train:\n  condition_image_size: {train}\neval:\n  condition_image_size: [1024, 1024]\n"
                    "  per_device_batch_size: 1\n")
    out = translate_file(path)
    assert out.args == ["--condition-image-size", str(side), "--eval-condition-image-size", "1024",
                        "--eval-batch-size", "1"]
    assert any(n.startswith("train.condition_image_size") and (n.endswith(f"→ --condition-image-size {side}")
                                                               if exact else "the side of the area" in n)
               for n in out.notes)
    cfg = parse(["train", "--flow-factory-config", str(path), "--reward", "jpeg_compressibility"])
    assert (cfg.model.condition_image_size, cfg.eval.eval_condition_image_size, cfg.eval.eval_batch_size) == (
        side, 1024, 1)
