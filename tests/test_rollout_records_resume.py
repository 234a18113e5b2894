"""Preparing a --save-rollout-data folder. A resumed run may rewrite its own rollout records, never mix them
with another configuration's: with --resume, a folder holding records of other settings was accepted and the
resumed run wrote its rollouts beside them (a later --load-rollout-data then read two runs as one). A file in
the folder's place failed with a bare "[Errno 17] File exists" naming no flag."""

import pytest

from diffrl.train.replay import RolloutRecord, prepare_save_dir, save_rollout

OURS = {"loss_type": "nft", "diffusion_model_family": "demo", "height": 64, "width": 64, "num_frames": None,
        "rollout_batch_size": 2, "n_samples_per_prompt": 4, "rollout_seed": 0, "reward": "shapes",
        "reward_frames": None}


def _folder_with_a_record(tmp_path, fingerprint):
    save_rollout(tmp_path, RolloutRecord(0, 0, fingerprint, {}, [], 0, []))
    return tmp_path


def test_resume_refuses_a_save_folder_of_another_configuration(tmp_path):
    folder = _folder_with_a_record(tmp_path, {**OURS, "n_samples_per_prompt": 8})
    with pytest.raises(ValueError, match=r"holds another run's records: rollout-000000\.safetensors was recorded "
                                         r"with --n-samples-per-prompt 8; this run has 4"):
        prepare_save_dir(folder, resume=True, fingerprint=OURS)


def test_resume_keeps_a_save_folder_of_its_own_configuration(tmp_path):
    folder = _folder_with_a_record(tmp_path, OURS)
    prepare_save_dir(folder, resume=True, fingerprint=OURS)
    with pytest.raises(FileExistsError, match="pass --resume"):  # without --resume, any records are refused
        prepare_save_dir(folder, resume=False, fingerprint=OURS)


def test_a_save_folder_that_is_a_file_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "records").write_text("not a folder")
    with pytest.raises(FileExistsError, match=r"--save-rollout-data .*records is a file, not a folder"):
        prepare_save_dir(tmp_path / "records", resume=False)


def test_a_save_folder_under_a_file_is_refused_naming_the_flag(tmp_path):
    """It failed with a NotADirectoryError traceback when the folder was made."""
    (tmp_path / "notes.txt").write_text("not a folder")
    with pytest.raises(FileExistsError, match=r"^--save-rollout-data .*notes.txt/records: .*notes.txt is a file, not a "
                                              r"folder; choose another --save-rollout-data$"):
        prepare_save_dir(tmp_path / "notes.txt" / "records", resume=False)
