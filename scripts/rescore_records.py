"""Re-judge a saved shapes evaluation (`diffrl evaluate --save-images`: records.jsonl and images/) with
the current verifier: strict accuracy and mean partial score before and after, overall (mean over
categories, as the report) and per category; the verdicts that changed with their new reasons; the
failure kinds; and the verifier's time per image (decoding the PNGs not included). Saved records
hold the verdicts of the verifier at evaluation time, so this shows what a change of the verifier
does to an evaluation (`diffrl.evaluation.shapes.rescore` gives the new records alone).

Usage: rescore_records.py FOLDER [FOLDER ...] [--show N] [--time-images N]
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import numpy as np

from diffrl.data.shapes import verify
from diffrl.evaluation.shapes import SampleRecord, judge, saved_samples, summarize


def _kind(reason: str) -> str:
    return reason.split(":")[0]


def rescore_folder(folder: Path, show: int) -> tuple[list[np.ndarray], list[str]]:
    """Print the comparison for one folder; returns its images and prompts."""
    samples = saved_samples(folder)
    rows, images = [row for row, _ in samples], [image for _, image in samples]
    old = [SampleRecord(row["prompt"], row["category"], row["seed"], row["strict"], row["score"], row["reason"])
           for row in rows]
    new = [judge(row, image) for row, image in samples]
    before, after = summarize(old), summarize(new)
    print(f"== {folder} ({len(rows)} images)")
    print(f"{'':<14} {'strict':>15} {'score':>15}")
    print(f"{'category':<14} {'old':>7} {'new':>7} {'old':>7} {'new':>7} {'n':>5}")
    for cat, c in after["categories"].items():
        was = before["categories"][cat]
        print(f"{cat:<14} {was['strict']:>7.3f} {c['strict']:>7.3f} {was['score']:>7.3f} {c['score']:>7.3f} "
              f"{c['n']:>5}")
    print(f"{'overall':<14} {before['overall_strict']:>7.3f} {after['overall_strict']:>7.3f} "
          f"{before['overall_score']:>7.3f} {after['overall_score']:>7.3f} {after['n']:>5}")
    print(f"{'per image':<14} {before['per_sample_strict']:>7.3f} {after['per_sample_strict']:>7.3f}")
    newly_failed = [(row, n) for row, o, n in zip(rows, old, new, strict=True) if o.strict and not n.strict]
    newly_passed = [(row, n) for row, o, n in zip(rows, old, new, strict=True) if not o.strict and n.strict]
    changed = [(row, o, n) for row, o, n in zip(rows, old, new, strict=True) if o.reason != n.reason]
    print(f"verdicts changed: {len(newly_failed)} pass -> fail, {len(newly_passed)} fail -> pass, "
          f"{len(changed)} reasons changed in all")
    print("new failures by kind:", dict(collections.Counter(_kind(n.reason) for _, n in newly_failed).most_common()))
    print("all failures by kind, old:", dict(collections.Counter(_kind(r.reason) for r in old if not r.strict)
                                              .most_common()))
    print("all failures by kind, new:", dict(collections.Counter(_kind(r.reason) for r in new if not r.strict)
                                              .most_common()))
    for row, n in (newly_failed + newly_passed)[:show]:
        print(f"  {row['file']}  {row['prompt']!r}: {n.reason}")
    return images, [row["prompt"] for row in rows]


def time_verifier(images: list[np.ndarray], prompts: list[str], passes: int = 5) -> float:
    """Milliseconds per image of `verify`: per image the fastest of `passes` calls (other work on the
    machine only ever adds time), averaged over the images."""
    fastest = np.full(len(images), np.inf)
    for _ in range(passes):
        for i, (image, prompt) in enumerate(zip(images, prompts, strict=True)):
            start = time.perf_counter()
            verify(image, prompt)
            fastest[i] = min(fastest[i], time.perf_counter() - start)
    return 1000 * float(fastest.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--show", type=int, default=20, help="changed verdicts to list per folder")
    parser.add_argument("--time-images", type=int, default=512, help="images (from all folders, in order) to time")
    args = parser.parse_args()
    images, prompts = [], []
    for folder in args.folders:
        folder_images, folder_prompts = rescore_folder(folder, args.show)
        images += folder_images
        prompts += folder_prompts
    if args.time_images:
        n = min(args.time_images, len(images))
        print(f"verifier: {time_verifier(images[:n], prompts[:n]):.2f} ms per image ({n} images, fastest of 5 each)")


if __name__ == "__main__":
    main()
