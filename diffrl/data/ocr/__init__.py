"""The OCR world: text rendering judged by OCR, on the published OCR prompt set (docs/ocr-world.md).

`prompts` holds the published held-out split and the generator of training prompts, `phrases` the texts
the generator renders, `render` the Pillow renders that pretrain the OCR demo model, `scenes` the stream of
(prompt, image) pairs pretraining reads.
"""
