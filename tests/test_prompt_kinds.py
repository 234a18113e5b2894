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
