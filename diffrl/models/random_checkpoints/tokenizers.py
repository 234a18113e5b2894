"""Tokenizers made in code for the random checkpoints (and the demo model): small vocabularies in the
formats the families' real tokenizers have, so the families' own text handling runs unchanged."""

from __future__ import annotations

import re
from collections.abc import Sequence

PAD, UNK, EOS = "<pad>", "<unk>", "</s>"
# Qwen's chat markers (the Qwen tokenizers' special tokens).
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_word_tokenizer(words: Sequence[str], max_length: int):
    """A word-level tokenizer made in code (no download): lowercase, split on whitespace and
    punctuation, unknown words → <unk>, an </s> appended, padded to `max_length`."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, unk_token=UNK, eos_token=EOS, model_max_length=max_length,
    )


def build_chat_tokenizer():
    """A character-level tokenizer with the Qwen chat markers and a chat template, made in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(QWEN_SPECIAL_TOKENS)}
    for code in range(32, 127):
        vocab.setdefault(chr(code), len(vocab))
    vocab.setdefault("\n", len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def build_qwen_word_tokenizer(words: Sequence[str], punctuation: Sequence[str], *, lowercase: bool,
                              specials: Sequence[str] = (), merged: Sequence[str] = ()):
    """A word-level tokenizer with Qwen's chat markers (and `specials`, e.g. Qwen-VL's vision markers) as special
    tokens. Like Qwen's own BPE tokenizer it keeps newlines and punctuation as tokens of their own (`merged`: runs of
    characters kept as one token, as Qwen's BPE merges `'s`), so Qwen-Image's prompt templates split into the
    token counts its pipelines cut at; unknown words map to `<unk>`."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*QWEN_SPECIAL_TOKENS, *specials, "<unk>", "\n", *punctuation,
                                                 *merged))}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),  # spaces separate words
        pre_tokenizers.Split(Regex("".join(re.escape(m) + "|" for m in merged) + r"\n|[^\w\s]"),
                             behavior="isolated"),  # newlines and punctuation stand alone
    ])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
                                        eos_token="<|im_end|>", model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": [*QWEN_SPECIAL_TOKENS[1:], *specials]})
    return tokenizer



# A position inside a double-quoted span: an odd number of '"' lies between it and the end of the prompt.
_INSIDE_QUOTES = r'(?=[^"]*"(?:[^"]*"[^"]*")*[^"]*\z)'
SPACE_IN_QUOTES = "▁"  # a space inside the quotes: a token of its own, so the text's words stay apart


def build_quoted_char_tokenizer(words: Sequence[str], max_length: int):
    """The OCR demo model's tokenizer, made in code: the text a prompt double-quotes is tokenized character by
    character (each printable ASCII character a token, a space inside the quotes `▁`), so the model can learn
    to draw any text letter by letter; the words around it are word-level (each word of `words` as given and
    capitalized, punctuation alone, unknown words → <unk>). An </s> is appended; padded to `max_length`."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2, SPACE_IN_QUOTES: 3}
    for code in range(33, 127):
        vocab.setdefault(chr(code), len(vocab))
    for word in words:
        vocab.setdefault(word, len(vocab))
        vocab.setdefault(word[:1].upper() + word[1:], len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Replace(Regex(" " + _INSIDE_QUOTES), SPACE_IN_QUOTES)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex('[^"]' + _INSIDE_QUOTES), behavior="isolated"),  # quoted characters alone
        pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"),  # spaces separate the other words
        pre_tokenizers.Split(Regex(r"[^\w\s" + SPACE_IN_QUOTES + "]"), behavior="isolated"),  # punctuation alone
    ])
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, unk_token=UNK, eos_token=EOS, model_max_length=max_length,
    )
