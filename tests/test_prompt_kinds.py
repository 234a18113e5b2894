"""Per-kind training rewards (rollout/reward/<tag>) never overwrite the rollout's own statistics."""

import json

import pytest

from diffrl.tasks import build_task
from diffrl.train.config import TrainConfig


def _task(path):
    return build_task(TrainConfig.flat(prompt_data=path, reward="jpeg_compressibility", eval_num_prompts=0))


@pytest.mark.parametrize(("key", "kind"), [("tag", "std"), ("category", "raw_mean")])
def test_a_kind_named_like_a_rollout_statistic_is_refused(tmp_path, key, kind):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, key: k}) for p, k in [("a cat", "counting"), ("a dog", kind)]))
    with pytest.raises(ValueError, match=rf"prompt kind '{kind}' .*rollout/reward/{kind}"):
        _task(path)


def test_geneval_tags_are_logged_beside_the_statistics(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "tag": k}) for p, k in [("a cat", "counting"), ("a dog", "colors")]))
    task = _task(path)
    observed = task.observe(task.train.records, [[1.0, 0.0], [0.5, 0.5]])
    assert observed == {"rollout/reward/counting": 0.5, "rollout/reward/colors": 0.5}


def _reward_task(path, reward):
    return build_task(TrainConfig.flat(prompt_data=path, reward=reward, eval_num_prompts=0))


def test_resume_with_another_reward_is_refused_naming_both(tmp_path):
    """The held-out series compared one reward's scores with another's (rollout 0 pickscore → rollout 3 jpeg)."""
    path = tmp_path / "prompts.txt"
    path.write_text("a cat\na dog\n")
    state = _reward_task(path, "multi:jpeg_compressibility=0.5,jpeg_incompressibility=0.5").state_dict()
    with pytest.raises(ValueError, match=r"--resume: the checkpoint was trained with --reward multi:jpeg_compressibility"
                                         r"=0.5,jpeg_incompressibility=0.5 .*asks for jpeg_compressibility"):
        _reward_task(path, "jpeg_compressibility").load_state_dict(state)
    _reward_task(path, "multi:jpeg_compressibility=0.5,jpeg_incompressibility=0.5").load_state_dict(state)


def test_the_same_reward_from_another_directory_resumes():
    from diffrl.tasks.prompt_set import reward_identity

    assert reward_identity("pickscore@/m/PickScore_v1,processor=/m/CLIP") == "pickscore"
    assert reward_identity("multi:pickscore@/a,processor=/b=0.5,hpsv2@/c/h.pt=0.5") == "multi:pickscore=0.5,hpsv2=0.5"
    assert reward_identity("pickscore@/x") == reward_identity("pickscore@/y") != reward_identity("clipscore@/x")
