"""`--reward remote@URL` against a reward server in Flow-Factory's format (examples/reward_server.py serving a diffrl
reward): the in-process values to the bit, a run identical to the in-process one, retries through a restart, and
one clear line for a server that is down or answers what cannot be a reward."""

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from diffrl.cli.main import main, parse
from diffrl.data.shapes import render_prompt
from diffrl.serving.server import serving_in_thread
from diffrl.rewards import get_reward
from diffrl.rewards.registry import TermScores
from diffrl.rewards.remote import RemoteReward, RewardServerError, RewardUnavailable, encode_samples
from diffrl.train.trainer import Trainer

_spec = importlib.util.spec_from_file_location("reward_server", Path(__file__).parents[1] / "examples/reward_server.py")
reward_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reward_server)

PROMPTS = ["a red circle", "two squares", "a green triangle to the left of a yellow circle", "a purple square"]


def shapes_images(prompts, seed=0) -> torch.Tensor:
    """Rendered ground truth, one in two smeared with noise: some pass the verifier, some fail it."""
    images = torch.stack([torch.from_numpy(render_prompt(p, seed + i)).permute(2, 0, 1).float() / 255
                          for i, p in enumerate(prompts)])
    images[1::2] = (images[1::2] + 0.3 * torch.rand(images[1::2].shape, generator=torch.Generator().manual_seed(seed))
                    ).clamp(0, 1)
    return images


def score(reward, images, prompts, metadata=None):
    values = reward(images, prompts, metadata)
    return asyncio.run(values) if asyncio.iscoroutine(values) else values


def test_a_served_reward_gives_the_in_process_values_to_the_bit():
    images = shapes_images(PROMPTS)
    for spec in ("shapes", "multi:shapes=1,white_background=0.5"):
        local = score(get_reward(spec), images, PROMPTS)
        with serving_in_thread(reward_server.make_app(get_reward(spec))) as url:
            remote = score(get_reward(f"remote@{url},batch=3,concurrency=2"), images, PROMPTS)
        assert remote == local and len(set(local)) > 1
        if spec.startswith("multi:"):  # each term comes back by name, for GDPO's per-reward normalization
            assert isinstance(remote, TermScores) and remote.terms == local.terms


def test_videos_go_as_frames_and_metadata_reaches_the_reward():
    seen = {}

    def spy(samples, prompts, metadata):
        seen.update(shape=tuple(samples.shape), metadata=metadata)
        return [float(samples[i].mean()) for i in range(len(prompts))]

    videos = torch.rand(2, 3, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    assert len(encode_samples(videos)["video"][0]) == 4
    with serving_in_thread(reward_server.make_app(spy)) as url:
        values = score(RemoteReward(url), videos, ["a", "b"], [{"seed": 3, "tensor": torch.ones(1)}, {"seed": 4}])
    assert seen == {"shape": (2, 3, 4, 8, 8), "metadata": [{"seed": 3}, {"seed": 4}]}  # what JSON can carry
    expected = torch.tensor(encode_samples.__globals__["to_uint8"](videos.permute(0, 2, 1, 3, 4).flatten(0, 1)),
                            dtype=torch.float32).div(255).view(2, 4, 8, 8, 3).mean(dim=(1, 2, 3, 4))
    assert values == pytest.approx(expected.tolist(), abs=1e-6)


def flaky_app(fail_first: int, answer=None):
    """A server whose first `fail_first` POSTs answer 503 (a restart), then `answer(body)` or the shapes reward."""
    app, calls, shapes = FastAPI(), {"n": 0}, reward_server.make_app(get_reward("shapes"))

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/compute")
    async def compute(request: Request):
        calls["n"] += 1
        body = await request.json()
        if calls["n"] <= fail_first:
            return PlainTextResponse("restarting", status_code=503)
        if answer is not None:
            return answer(body)
        route = next(r for r in shapes.routes if getattr(r, "path", "") == "/compute")
        return await route.endpoint(body)

    return app, calls


def test_a_server_that_restarts_costs_retries_not_the_run():
    images = shapes_images(PROMPTS)
    app, calls = flaky_app(fail_first=2)
    with serving_in_thread(app) as url:
        values = score(RemoteReward(url, retries=3), images, PROMPTS)
    assert values == score(get_reward("shapes"), images, PROMPTS) and calls["n"] == 3


@pytest.mark.parametrize("answer, message", [
    (lambda body: {"rewards": [0.5]}, "answered 1 rewards for 4 samples"),
    (lambda body: PlainTextResponse('{"rewards": [0.1, NaN, 0.2, 0.3]}', media_type="application/json"),
     "answered nan as rewards\\[1\\]"),
    (lambda body: {"rewards": [0.1, "high", 0.2, 0.3]}, "answered 'high' as rewards\\[1\\]"),
    (lambda body: {"scores": [1, 2, 3, 4]}, "without a list 'rewards'"),
    (lambda body: PlainTextResponse("oops"), "not JSON"),
    (lambda body: JSONResponse({"detail": "bad image"}, status_code=422), "refused POST /compute with HTTP 422"),
])
def test_an_answer_that_cannot_be_a_reward_stops_in_one_line(answer, message):
    app, calls = flaky_app(fail_first=0, answer=answer)
    with serving_in_thread(app) as url, pytest.raises(RewardServerError, match=f"reward server {url} .*{message}"):
        score(RemoteReward(url, retries=3), shapes_images(PROMPTS), PROMPTS)
    assert calls["n"] == 1  # not retried: the same question gets the same wrong answer


def test_a_server_that_is_down_is_named_before_anything_loads():
    with serving_in_thread(FastAPI()) as url:
        pass  # stopped: nothing listens on its port now
    with pytest.raises(RewardUnavailable, match=f"reward server {url} does not answer GET /health"):
        get_reward(f"remote@{url}")
    with pytest.raises(RewardUnavailable, match=f"reward server {url}: no answer to POST /compute after 2 attempts"):
        score(RemoteReward(url, retries=1), shapes_images(PROMPTS[:1]), PROMPTS[:1])
    with pytest.raises(ValueError, match="timeout='soon' is not a float"):
        get_reward(f"remote@{url},timeout=soon")
    with pytest.raises(ValueError, match="'tries=3' is not an option"):
        get_reward(f"remote@{url},tries=3")


SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "2",
         "--global-batch-size", "8", "--num-steps-per-rollout", "1", "--micro-batch-size", "8",
         "--diffusion-num-steps", "3", "--eval-images-per-category", "0", "--val-images-per-category", "0",
         "--device", "cpu", "--loss-type", "nft"]


def test_a_run_scored_by_the_server_is_the_in_process_run(tiny_model_dir, tmp_path):
    records = {}
    with serving_in_thread(reward_server.make_app(get_reward("shapes"))) as url:
        for name, reward in (("local", "shapes"), ("remote", f"remote@{url}")):
            cfg = parse(["train", *SMALL, "--reward", reward, "--model-path", str(tiny_model_dir),
                         "--output-dir", str(tmp_path / name), "--num-rollout", "2"])
            trainer = Trainer(cfg)
            records[name] = [trainer.rollout_and_update(k) for k in range(2)]
    keep = ("rollout/reward/raw_mean", "rollout/reward/std", "train/loss", "train/grad_norm")
    assert [{k: r[k] for k in keep} for r in records["remote"]] == [{k: r[k] for k in keep} for r in records["local"]]


def test_garbage_mid_run_stops_the_run_in_one_line_and_keeps_its_checkpoint(tiny_model_dir, tmp_path, capsys):
    good = {"n": 0}

    def answer(body):  # two rollouts' worth of good answers (4 microgroups each), then a wrong count
        good["n"] += 1
        if good["n"] > 4:
            return {"rewards": [0.0]}
        return {"rewards": [0.5 + 0.1 * i for i in range(len(body["prompt"]))]}

    app, _ = flaky_app(fail_first=0, answer=answer)
    run = tmp_path / "run"
    with serving_in_thread(app) as url:
        code = main(["train", *SMALL, "--reward", f"remote@{url}", "--model-path", str(tiny_model_dir),
                     "--output-dir", str(run), "--num-rollout", "3", "--checkpoint-interval", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"error: reward server {url} answered 1 rewards for 2 samples")
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("rollout-"))
    assert checkpoints and json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["rollout"] >= 0


def test_a_reward_server_gone_for_good_ends_the_run_in_one_line(tiny_model_dir, tmp_path, capsys):
    with serving_in_thread(FastAPI()) as url:
        pass
    code = main(["train", *SMALL, "--reward", f"remote@{url}", "--model-path", str(tiny_model_dir),
                 "--output-dir", str(tmp_path / "run"), "--num-rollout", "1"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(f"error: reward server {url} does not answer GET /health") and err.count("\n") == 1
