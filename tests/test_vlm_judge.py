"""`--reward vlm@URL`: a VLM judge through the real `openai` client against a local server that answers in the
chat-completions shape, with log-probabilities. The score is P(yes) / (P(yes) + P(no)) of the first token."""

import asyncio
import base64
import io
import math

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request
from PIL import Image

from diffrl.serving.server import serving_in_thread
from diffrl.rewards import get_reward
from diffrl.rewards.vlm import JudgeError, yes_probability
from diffrl.utils.images import to_uint8

import openai  # noqa: E402,F401  (the test extras install the client; the judge imports it lazily)


def judge_app(mode: str = "logprobs"):
    """A judge whose P(yes) is the image's mean brightness, split over "Yes" and " yes" (and "No" / "no"), with a
    distracting "Maybe"; `mode` "text" answers without log-probabilities, "shrug" answers "Perhaps"."""
    app, seen = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        image_part, text_part = body["messages"][0]["content"]
        png = base64.b64decode(image_part["image_url"]["url"].split(",", 1)[1])
        brightness = float(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).mean() / 255)
        seen.append({"model": body["model"], "text": text_part["text"], "max_tokens": body["max_tokens"],
                     "top_logprobs": body.get("top_logprobs")})
        p = min(max(brightness, 1e-6), 1 - 1e-6)
        top = [("Yes", 0.7 * p), (" yes", 0.3 * p), ("No", 0.6 * (1 - p)), ("no", 0.2 * (1 - p)), ("Maybe", 0.2 * (1 - p))]

        def entry(token, prob):
            return {"token": token, "logprob": math.log(prob), "bytes": list(token.encode())}

        content = "Yes" if p >= 0.5 else "No"
        logprobs = {"content": [{**entry(content, dict(top)[content]), "top_logprobs": [entry(*t) for t in top]}]}
        if mode != "logprobs":
            logprobs, content = None, ("No." if mode == "text" else "Perhaps")
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}

    return app, seen


def score(reward, images, prompts):
    return asyncio.run(reward(images, prompts, None))


def test_the_judge_scores_yes_against_no_through_the_openai_client():
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.2, 0.6, 1.0]).view(3, 1, 1, 1)
    prompts = ["a red circle", "two squares", "a blue, tall triangle"]
    app, seen = judge_app()
    with serving_in_thread(app) as url:
        values = score(get_reward(f"vlm@{url}/v1,model=judge-7b,concurrency=2,question=Is it {{prompt}}, truly?"),
                       images, prompts)
    brightness = [float(to_uint8(images[i:i + 1]).mean() / 255) for i in range(3)]
    # (0.7p + 0.3p) / (0.7p + 0.3p + 0.6(1−p) + 0.2(1−p)): "Maybe" counts for neither side.
    expected = [p / (p + 0.8 * (1 - p)) for p in brightness]
    assert values == pytest.approx(expected, rel=1e-9) and values[0] < values[1] < values[2]
    assert sorted(s["text"] for s in seen) == sorted(f"Is it {p}, truly?" for p in prompts)  # commas kept
    assert {(s["model"], s["max_tokens"], s["top_logprobs"]) for s in seen} == {("judge-7b", 1, 20)}


def test_a_video_is_judged_frame_by_frame():
    video = torch.zeros(1, 3, 2, 4, 4)
    video[:, :, 1] = 1.0  # a black frame and a white one
    app, seen = judge_app()
    with serving_in_thread(app) as url:
        (value,) = score(get_reward(f"vlm@{url}/v1,model=m"), video, ["a flash"])
    assert len(seen) == 2 and value == pytest.approx((1e-6 / (1e-6 + 0.8 * (1 - 1e-6)) + 1 / (1 + 0.8e-6)) / 2)


def test_without_logprobs_the_text_decides_and_a_shrug_stops_the_run():
    app, _ = judge_app("text")
    with serving_in_thread(app) as url:
        assert score(get_reward(f"vlm@{url}/v1,model=m"), torch.ones(1, 3, 4, 4), ["x"]) == [0.0]
    app, _ = judge_app("shrug")
    with serving_in_thread(app) as url, pytest.raises(JudgeError, match="answered 'Perhaps' for 'x', neither yes nor no"):
        score(get_reward(f"vlm@{url}/v1,model=m"), torch.ones(1, 3, 4, 4), ["x"])


def test_yes_probability_by_hand_and_bad_specs():
    assert yes_probability([("YES", math.log(0.3)), (" No", math.log(0.1))], "") == pytest.approx(0.75)
    assert yes_probability([("Sure", 0.0)], " yes, it does") == 1.0
    assert yes_probability([], "") is None
    with pytest.raises(ValueError, match="name the judge's model"):
        get_reward("vlm@http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="'temperature=0' is not an option"):
        get_reward("vlm@http://127.0.0.1:1/v1,model=m,temperature=0")
