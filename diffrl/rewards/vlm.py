"""`vlm@URL`: a vision-language model as the judge, behind an OpenAI-compatible chat-completions API (vLLM, sglang,
or any server speaking that API).

Each image goes to the judge with a yes/no question about its prompt; the score is the judge's probability of
"Yes" against "No" for the first token of its answer, read from the top log-probabilities the API returns:
`P(yes) / (P(yes) + P(no))`, where each side sums the tokens that spell the word in any case and with a leading
space. When neither word is among the top tokens, the answer's text decides (1 for yes, 0 for no); an answer that
is neither stops the run with one line naming the server and what it said.

Spec: `vlm@http://HOST:PORT/v1,model=NAME[,concurrency=N][,timeout=S][,question=TEXT]`. `question` goes last and
takes the rest of the spec, commas included; `{prompt}` in it stands for the sample's prompt. The API key is
`DIFFRL_VLM_API_KEY` (else `OPENAI_API_KEY`, else a placeholder, which local servers accept).

Serving a real judge, e.g. with vLLM: `vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8000` on the judge's machine, then
`--reward vlm@http://HOST:8000/v1,model=Qwen/Qwen2.5-VL-7B-Instruct`. sglang: `python -m sglang.launch_server
--model-path … --port 8000`, the same spec. The judge sees 8-bit PNGs (`utils.images.to_uint8`); a video is judged
frame by frame and scored by the mean of its frames.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass

import torch

from diffrl.rewards.frames import as_frames
from diffrl.rewards.remote import png_base64
from diffrl.utils.images import to_uint8

OPTIONS = ("model", "concurrency", "timeout", "question")
DEFAULT_QUESTION = 'Does this image show "{prompt}"? Answer Yes or No.'
TOP_LOGPROBS = 20  # the most the OpenAI API returns per position


class JudgeError(ValueError):
    """A judge's answer that is no score: neither yes nor no, or no answer at all."""


def yes_probability(top_logprobs: list[tuple[str, float]], text: str) -> float | None:
    """P(yes) / (P(yes) + P(no)) from the first position's top tokens, or from the text when neither word is
    among them; None when neither says anything."""
    yes = sum(math.exp(lp) for token, lp in top_logprobs if token.strip().lower() == "yes")
    no = sum(math.exp(lp) for token, lp in top_logprobs if token.strip().lower() == "no")
    if yes + no > 0:
        return yes / (yes + no)
    word = text.strip().split()[0].strip(".,!:;").lower() if text.strip() else ""
    return {"yes": 1.0, "no": 0.0}.get(word)


@dataclass(frozen=True)
class VlmJudge:
    """`score(images, prompts, metadata)` by a chat-completions judge; async, so judging overlaps generation."""

    url: str
    model: str
    question: str = DEFAULT_QUESTION
    concurrency: int = 8
    timeout: float = 120.0

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward vlm@{self.url}: the API's base URL starts with http:// or https://")
        if not self.model:
            raise ValueError(f"reward vlm@{self.url}: name the judge's model: vlm@{self.url},model=NAME")
        if self.concurrency < 1 or self.timeout <= 0:
            raise ValueError(f"reward vlm@{self.url}: concurrency >= 1 and timeout > 0")

    async def __call__(self, images: torch.Tensor, prompts, metadata=None) -> list[float]:
        # The client library is an optional dependency (`pip install diffrl[judge]`): imported where it is used.
        from openai import AsyncOpenAI

        key = os.environ.get("DIFFRL_VLM_API_KEY") or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        client = AsyncOpenAI(base_url=self.url, api_key=key, timeout=self.timeout, max_retries=3)
        slots = asyncio.Semaphore(self.concurrency)

        async def judge(pixels, prompt: str) -> float:
            content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_base64(pixels)}"}},
                       {"type": "text", "text": self.question.replace("{prompt}", prompt)}]
            async with slots:
                answer = await client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": content}], max_tokens=1, temperature=0,
                    logprobs=True, top_logprobs=TOP_LOGPROBS)
            choice = answer.choices[0] if answer.choices else None
            if choice is None:
                raise JudgeError(f"judge {self.url} ({self.model}) answered no choice for {prompt!r}")
            first = choice.logprobs.content[0] if choice.logprobs and choice.logprobs.content else None
            top = [(t.token, t.logprob) for t in first.top_logprobs] if first is not None else []
            text = choice.message.content or ""
            score = yes_probability(top, text)
            if score is None:
                raise JudgeError(f"judge {self.url} ({self.model}) answered {text!r} for {prompt!r}, neither yes nor "
                                 "no; ask a question it answers with Yes or No (question=…)")
            return score

        frames, frame_prompts, _, f = as_frames(images, list(prompts), metadata)  # a video: each frame judged
        try:
            scores = await asyncio.gather(*(judge(p, prompt) for p, prompt in zip(to_uint8(frames), frame_prompts,
                                                                                   strict=True)))
        finally:
            await client.close()
        return [sum(scores[i:i + f]) / f for i in range(0, len(scores), f)]


def vlm_judge(url: str, options: dict[str, str]) -> VlmJudge:
    """The judge of a `vlm@URL,OPTION=VALUE…` spec."""
    kinds = {"model": str, "question": str, "concurrency": int, "timeout": float}
    values = {}
    for key, value in options.items():
        try:
            values[key] = kinds[key](value)
        except ValueError:
            raise ValueError(f"reward vlm@{url}: {key}={value!r} is not a {kinds[key].__name__}") from None
    if "model" not in values:
        raise ValueError(f"reward vlm@{url}: name the judge's model: vlm@{url},model=NAME")
    return VlmJudge(url, **values)
