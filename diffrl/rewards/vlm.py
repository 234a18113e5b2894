"""`vlm@URL`: a vision-language model as the judge, behind an OpenAI-compatible chat-completions API (vLLM, sglang,
or any server speaking that API).

Each image goes to the judge with a yes/no question about its prompt; the score is the judge's probability of
"Yes" against "No" for the first token of its answer, read from the top log-probabilities the API returns:
`P(yes) / (P(yes) + P(no))`, where each side sums the tokens that spell the word in any case and with a leading
space. When neither word is among the top tokens, the answer's text decides (1 for yes, 0 for no); an answer that
is neither stops the run with one line naming the server and what it said.

An image-conditioned sample (an edit, an image-to-video clip: the metadata's `condition_images`) is judged with its
sources: the message holds the source images first and the output last, and the default question asks whether the
instruction was carried out on the source (for a video: whether the clip continues from its first frame), since an
output alone cannot tell an edit done from a picture that merely fits the text. `sources=no` sends the output alone.

A rubric asks several yes/no questions of each sample and scores their mean P(yes): `rubric=edit` (the instruction
carried out; what it does not ask to change kept; no artifacts) or `rubric=image` (the prompt shown; well composed;
no artifacts), or several questions of one's own separated by ` || ` in `question`. One aspect alone is what RL
exploits: an edit judged only on "was it done" learns to repaint the whole picture.

Spec: `vlm@http://HOST:PORT/v1,model=NAME[,concurrency=N][,timeout=S][,sources=yes|no][,rubric=edit|image]
[,question=TEXT]`. `question` goes last and takes the rest of the spec, commas included; `{prompt}` in it stands for
the sample's prompt (the instruction, for an edit); one question serves every sample, with or without sources. The API key is
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

from diffrl.data.condition_images import CONDITION_IMAGES_KEY
from diffrl.rewards.frames import as_frames
from diffrl.rewards.remote import png_base64
from diffrl.utils.images import to_uint8

OPTIONS = ("model", "concurrency", "timeout", "sources", "rubric", "question")
QUESTION_SEPARATOR = " || "  # several questions in `question=`: a rubric of one's own
DEFAULT_QUESTION = 'Does this image show "{prompt}"? Answer Yes or No.'
# With sources: the message's images are the sources, then the output.
EDIT_QUESTION = ('The last image was made from the image before it by following the instruction "{prompt}". Was '
                 'the instruction carried out, with everything it does not ask to change left as it was? Answer Yes '
                 'or No.')
EDITS_QUESTION = ('The last image was made from the {count} images before it by following the instruction '
                  '"{prompt}". Was the instruction carried out, with everything it does not ask to change left as it '
                  'was? Answer Yes or No.')
RUBRICS = {
    "edit": ('The last image was made from the image(s) before it by following the instruction "{prompt}". Was the '
             'instruction carried out? Answer Yes or No.',
             'The last image was made from the image(s) before it by following the instruction "{prompt}". Is '
             'everything the instruction does not ask to change (subjects, background, layout, colours, style) as it '
             'was? Answer Yes or No.',
             'Is the last image free of visible artifacts, distortions and broken details? Answer Yes or No.'),
    "image": ('Does this image show "{prompt}"? Answer Yes or No.',
              'Is this image well composed and pleasing to look at? Answer Yes or No.',
              'Is this image free of visible artifacts, distortions and broken details? Answer Yes or No.'),
}
VIDEO_QUESTION = ('The first image is the starting frame of a video and the second is a frame of that video. Does '
                  'the video continue from that starting frame and show "{prompt}"? Answer Yes or No.')
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
    question: str | None = None  # None: DEFAULT_QUESTION, or with sources EDIT(S)_QUESTION / VIDEO_QUESTION
    rubric: str | None = None  # a RUBRICS name: its questions instead of one
    concurrency: int = 8
    timeout: float = 120.0
    sources: bool = True

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward vlm@{self.url}: the API's base URL starts with http:// or https://")
        if not self.model:
            raise ValueError(f"reward vlm@{self.url}: name the judge's model: vlm@{self.url},model=NAME")
        if self.concurrency < 1 or self.timeout <= 0:
            raise ValueError(f"reward vlm@{self.url}: concurrency >= 1 and timeout > 0")
        if self.rubric is not None and self.rubric not in RUBRICS:
            raise ValueError(f"reward vlm@{self.url}: rubric={self.rubric!r} is none of {', '.join(RUBRICS)}")
        if self.rubric is not None and self.question is not None:
            raise ValueError(f"reward vlm@{self.url}: rubric= and question= both ask the questions; give one")
        if self.question is not None and not all(q.strip() for q in self.question.split(QUESTION_SEPARATOR)):
            raise ValueError(f"reward vlm@{self.url}: an empty question in {self.question!r}")

    async def __call__(self, images: torch.Tensor, prompts, metadata=None) -> list[float]:
        # The client library is an optional dependency (`pip install diffrl[judge]`): imported where it is used.
        from openai import AsyncOpenAI

        key = os.environ.get("DIFFRL_VLM_API_KEY") or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        client = AsyncOpenAI(base_url=self.url, api_key=key, timeout=self.timeout, max_retries=3)
        slots = asyncio.Semaphore(self.concurrency)

        def picture(pixels) -> dict:
            return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_base64(pixels)}"}}

        async def judge(pixels, prompt: str, sources: list, video: bool) -> float:
            questions = self._questions(len(sources), video)
            return sum(await asyncio.gather(*(ask(pixels, prompt, sources, q) for q in questions))) / len(questions)

        async def ask(pixels, prompt: str, sources: list, question: str) -> float:
            text = question.replace("{prompt}", prompt).replace("{count}", str(len(sources)))
            content = [*(picture(to_uint8(s[None].float())[0]) for s in sources), picture(pixels),
                       {"type": "text", "text": text}]
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

        frames, frame_prompts, frame_metadata, f = as_frames(images, list(prompts), metadata)  # a video: by frame
        frame_sources = [list((m or {}).get(CONDITION_IMAGES_KEY) or ()) if self.sources else []
                         for m in (frame_metadata or [None] * len(frame_prompts))]
        try:
            scores = await asyncio.gather(*(judge(p, prompt, sources, f > 1) for p, prompt, sources in zip(
                to_uint8(frames), frame_prompts, frame_sources, strict=True)))
        finally:
            await client.close()
        return [sum(scores[i:i + f]) / f for i in range(0, len(scores), f)]

    def _questions(self, sources: int, video: bool) -> list[str]:
        if self.rubric is not None:
            return list(RUBRICS[self.rubric])
        if self.question is not None:
            return self.question.split(QUESTION_SEPARATOR)
        return [self._default_question(sources, video)]

    @staticmethod
    def _default_question(sources: int, video: bool) -> str:
        if not sources:
            return DEFAULT_QUESTION
        if video:
            return VIDEO_QUESTION
        return EDIT_QUESTION if sources == 1 else EDITS_QUESTION


def vlm_judge(url: str, options: dict[str, str]) -> VlmJudge:
    """The judge of a `vlm@URL,OPTION=VALUE…` spec."""
    kinds = {"model": str, "question": str, "concurrency": int, "timeout": float, "sources": _yes_no, "rubric": str}
    values = {}
    for key, value in options.items():
        try:
            values[key] = kinds[key](value)
        except ValueError:
            raise ValueError(f"reward vlm@{url}: {key}={value!r} is not a {_kind_name(kinds[key])}") from None
    if "model" not in values:
        raise ValueError(f"reward vlm@{url}: name the judge's model: vlm@{url},model=NAME")
    return VlmJudge(url, **values)


def _yes_no(value: str) -> bool:
    words = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}
    if value.strip().lower() not in words:
        raise ValueError(value)
    return words[value.strip().lower()]


def _kind_name(kind) -> str:
    return "yes or no" if kind is _yes_no else kind.__name__
