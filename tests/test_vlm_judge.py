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
from diffrl.rewards.vlm import (DEFAULT_QUESTION, EDIT_QUESTION, EDITS_QUESTION, RUBRICS, VIDEO_QUESTION,
                                JudgeError, yes_probability)
from diffrl.utils.images import to_uint8

import openai  # noqa: E402,F401  (the test extras install the client; the judge imports it lazily)


BY_QUESTION = {"carried out": 0.9, "as it was": 0.2, "artifacts": 0.6, "alpha": 0.3, "beta": 0.7}


def judge_app(mode: str = "logprobs"):
    """A judge whose P(yes) is the last image's mean brightness, split over "Yes" and " yes" (and "No" / "no"), with
    a distracting "Maybe"; `mode` "text" answers without log-probabilities, "shrug" answers "Perhaps", "edit" makes
    P(yes) one minus the mean absolute difference between the last image and the first (an edit that changed
    nothing of its source scores 1)."""
    app, seen = FastAPI(), []

    def pixels(part) -> np.ndarray:
        png = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
        return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.float64) / 255

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        *image_parts, text_part = body["messages"][0]["content"]
        assert all(part["type"] == "image_url" for part in image_parts) and text_part["type"] == "text"
        images = [pixels(part) for part in image_parts]
        seen.append({"model": body["model"], "text": text_part["text"], "max_tokens": body["max_tokens"],
                     "top_logprobs": body.get("top_logprobs"), "images": images})
        if mode == "edit":
            p = 1 - float(np.abs(images[-1] - images[0]).mean())
        elif mode == "by_question":  # P(yes) set by the question: a rubric's aspects answered apart
            p = next((v for key, v in BY_QUESTION.items() if key in text_part["text"]), 0.5)
        else:
            p = float(images[-1].mean())
        p = min(max(p, 1e-6), 1 - 1e-6)
        top = [("Yes", 0.7 * p), (" yes", 0.3 * p), ("No", 0.6 * (1 - p)), ("no", 0.2 * (1 - p)), ("Maybe", 0.2 * (1 - p))]

        def entry(token, prob):
            return {"token": token, "logprob": math.log(prob), "bytes": list(token.encode())}

        content = "Yes" if p >= 0.5 else "No"
        logprobs = {"content": [{**entry(content, dict(top)[content]), "top_logprobs": [entry(*t) for t in top]}]}
        if mode not in ("logprobs", "edit", "by_question"):
            logprobs, content = None, ("No." if mode == "text" else "Perhaps")
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}

    return app, seen


def score(reward, images, prompts, metadata=None):
    return asyncio.run(reward(images, prompts, metadata))


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


def test_an_edit_is_judged_beside_its_sources():
    """The judge sees each sample's condition images first and the output last, asked whether the instruction was
    carried out on the source; `sources=no` sends the output alone with the plain question."""
    source = torch.zeros(3, 8, 8)
    source[0] = 1.0  # a red source
    outputs = torch.stack([source, torch.zeros(3, 8, 8)])  # the first output left its source as it was, the second not
    metadata = [{"condition_images": [source]}, {"condition_images": [source]}]
    app, seen = judge_app("edit")
    with serving_in_thread(app) as url:
        unchanged, blackened = score(get_reward(f"vlm@{url}/v1,model=m"), outputs, ["keep it", "keep it"], metadata)
    def judged(p):  # the stub's P(yes) against "No" and "no" (its "Maybe" counts for neither)
        return p / (p + 0.8 * (1 - p))

    # Unchanged: P(yes) clamped at 1 - 1e-6; blackened: one channel of three differs everywhere, P(yes) 2/3.
    assert unchanged == pytest.approx(judged(1 - 1e-6))
    assert blackened == pytest.approx(judged(2 / 3)) and blackened < unchanged
    assert all(len(s["images"]) == 2 and np.array_equal(s["images"][0][..., 0], np.ones((8, 8))) for s in seen)
    assert {s["text"] for s in seen} == {EDIT_QUESTION.replace("{prompt}", "keep it")}

    two_sources = [{"condition_images": [source, torch.ones(3, 8, 8)]}]
    app, seen = judge_app("edit")
    with serving_in_thread(app) as url:
        score(get_reward(f"vlm@{url}/v1,model=m"), outputs[:1], ["merge them"], two_sources)
        score(get_reward(f"vlm@{url}/v1,model=m,sources=no"), outputs[:1], ["merge them"], two_sources)
        score(get_reward(f"vlm@{url}/v1,model=m,question=Done: {{prompt}}?"), outputs[:1], ["merge them"], two_sources)
    assert [len(s["images"]) for s in seen] == [3, 1, 3]
    assert seen[0]["text"] == EDITS_QUESTION.replace("{count}", "2").replace("{prompt}", "merge them")
    assert seen[1]["text"] == DEFAULT_QUESTION.replace("{prompt}", "merge them")
    assert seen[2]["text"] == "Done: merge them?"


def test_an_image_to_video_clip_is_judged_frame_by_frame_beside_its_first_frame():
    video = torch.zeros(1, 3, 3, 4, 4)
    source = torch.ones(3, 4, 4)
    app, seen = judge_app("edit")
    with serving_in_thread(app) as url:
        (value,) = score(get_reward(f"vlm@{url}/v1,model=m"), video, ["it fades"], [{"condition_images": [source]}])
    assert len(seen) == 3 and all(len(s["images"]) == 2 for s in seen)
    assert {s["text"] for s in seen} == {VIDEO_QUESTION.replace("{prompt}", "it fades")}
    assert value == pytest.approx(1e-6 / (1e-6 + 0.8 * (1 - 1e-6)))  # every frame black against a white source


def test_the_sources_option_takes_yes_or_no():
    with pytest.raises(ValueError, match="sources='maybe' is not a yes or no"):
        get_reward("vlm@http://127.0.0.1:1/v1,model=m,sources=maybe")


def _judged(p):  # the stub's P(yes) against "No" and "no" (its "Maybe" counts for neither)
    return p / (p + 0.8 * (1 - p))


def test_a_rubric_asks_each_aspect_and_scores_their_mean():
    source = torch.zeros(3, 8, 8)
    metadata = [{"condition_images": [source]}]
    app, seen = judge_app("by_question")
    with serving_in_thread(app) as url:
        (edit,) = score(get_reward(f"vlm@{url}/v1,model=m,rubric=edit"), source[None], ["paint it"], metadata)
        (own,) = score(get_reward(f"vlm@{url}/v1,model=m,question=alpha {{prompt}}? || beta, with commas?"),
                       source[None], ["x"])
    assert edit == pytest.approx((_judged(0.9) + _judged(0.2) + _judged(0.6)) / 3)
    assert own == pytest.approx((_judged(0.3) + _judged(0.7)) / 2)
    edit_texts = sorted(s["text"] for s in seen[:3])
    assert edit_texts == sorted(q.replace("{prompt}", "paint it") for q in RUBRICS["edit"])
    assert all(len(s["images"]) == 2 for s in seen[:3]) and [len(s["images"]) for s in seen[3:]] == [1, 1]
    assert sorted(s["text"] for s in seen[3:]) == ["alpha x?", "beta, with commas?"]


def test_rubric_options_are_checked():
    with pytest.raises(ValueError, match="rubric='style' is none of edit, image"):
        get_reward("vlm@http://127.0.0.1:1/v1,model=m,rubric=style")
    with pytest.raises(ValueError, match="rubric= and question= both ask the questions"):
        get_reward("vlm@http://127.0.0.1:1/v1,model=m,rubric=edit,question=Is it?")
    with pytest.raises(ValueError, match="an empty question"):
        get_reward("vlm@http://127.0.0.1:1/v1,model=m,question=Is it? || ")
