"""Prompt datasets: the three layouts, metadata, errors, and the per-epoch shuffled stream's resume."""

import json

import pytest

from diffrl.data.prompts import PromptRecord, PromptStream, load_prompts


def test_txt_file_one_prompt_per_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('a sign that says "hi"\n\n  a cat  \n')
    assert load_prompts(path) == [PromptRecord('a sign that says "hi"'), PromptRecord("a cat")]


def test_jsonl_other_keys_become_metadata(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "two dogs", "tag": "counting", "include": [{"class": "dog", "count": 2}]}) + "\n")
    (record,) = load_prompts(path, input_key="text")
    assert record.prompt == "two dogs"
    assert record.metadata == {"tag": "counting", "include": [{"class": "dog", "count": 2}]}


def test_directory_splits_prefer_jsonl(tmp_path):
    (tmp_path / "train.txt").write_text("plain\n")
    (tmp_path / "test.txt").write_text("held out\n")
    assert [r.prompt for r in load_prompts(tmp_path, "train")] == ["plain"]
    (tmp_path / "train_metadata.jsonl").write_text(json.dumps({"prompt": "rich", "k": 1}) + "\n")
    assert load_prompts(tmp_path, "train") == [PromptRecord("rich", {"k": 1})]
    assert [r.prompt for r in load_prompts(tmp_path, "test")] == ["held out"]


@pytest.mark.parametrize("content, message", [
    ("", "no prompts"),
    ('{"prompt": "x"}\nnot json\n', "p.jsonl:2: not JSON"),
    ('{"caption": "x"}\n', "no text under --input-key 'prompt' (keys: caption)"),
    ('["x"]\n', "expected a JSON object"),
    # Keys diffrl sets per sample in the reward's metadata: the file's value would be overwritten unseen.
    ('{"prompt": "x"}\n{"prompt": "y", "tag": "a", "seed": 7}\n', "p.jsonl:2: metadata key 'seed' is set by diffrl"),
    ('{"prompt": "x", "sample_index": 0}\n', "p.jsonl:1: metadata key 'sample_index' is set by diffrl"),
])
def test_bad_jsonl_names_the_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_prompts(path)


def test_a_byte_order_mark_is_not_part_of_the_first_prompt_and_other_encodings_are_refused(tmp_path):
    """Windows editors start UTF-8 files with a BOM; it must not reach the model (txt) nor break JSON (jsonl)."""
    (tmp_path / "p.txt").write_bytes('\ufeffa sign that says "café"\r\nsecond\r\n'.encode())
    assert [r.prompt for r in load_prompts(tmp_path / "p.txt")] == ['a sign that says "café"', "second"]
    (tmp_path / "p.jsonl").write_bytes(('\ufeff' + json.dumps({"prompt": "x", "k": 1}) + "\n").encode())
    assert load_prompts(tmp_path / "p.jsonl") == [PromptRecord("x", {"k": 1})]
    (tmp_path / "latin1.txt").write_bytes("first\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt:2: not UTF-8"):
        load_prompts(tmp_path / "latin1.txt")


def test_missing_paths_and_splits(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_prompts(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="no test_metadata.jsonl or test.txt"):
        load_prompts(tmp_path, "test")
    (tmp_path / "p.csv").write_text("a\n")
    with pytest.raises(ValueError, match="expected a .txt file"):
        load_prompts(tmp_path / "p.csv")


def test_stream_visits_every_prompt_once_per_epoch_in_a_new_order():
    records = [PromptRecord(str(i)) for i in range(7)]
    stream = PromptStream(records, seed=3)
    first, second = stream.take(7), stream.take(7)
    assert sorted(r.prompt for r in first) == sorted(r.prompt for r in second) == [str(i) for i in range(7)]
    assert first != second  # each epoch has its own permutation
    assert {k: stream.state_dict()[k] for k in ("epoch", "position", "size")} == {"epoch": 1, "position": 7, "size": 7}


def test_stream_resumes_exactly_across_an_epoch_boundary():
    records = [PromptRecord(str(i)) for i in range(5)]
    uninterrupted = PromptStream(records, seed=1)
    expected = [uninterrupted.take(3) for _ in range(4)]
    stream = PromptStream(records, seed=1)
    got = [stream.take(3), stream.take(3)]
    resumed = PromptStream(records, seed=1)
    resumed.load_state_dict(stream.state_dict())
    got += [resumed.take(3), resumed.take(3)]
    assert got == expected
    with pytest.raises(ValueError, match="prompt set of 5 prompts"):
        PromptStream(records[:4]).load_state_dict(stream.state_dict())


def test_stream_refuses_a_dataset_of_the_same_size_with_other_prompts_or_metadata():
    records = [PromptRecord(str(i), {"tag": "a"}) for i in range(5)]
    state = PromptStream(records, seed=1).state_dict()
    PromptStream([PromptRecord(r.prompt, dict(r.metadata)) for r in records], seed=1).load_state_dict(state)
    for edited in ([PromptRecord("x"), *records[1:]], [PromptRecord("0", {"tag": "b"}), *records[1:]],
                   records[::-1]):
        with pytest.raises(ValueError, match=r"^--resume: --prompt-data p.jsonl is not the prompt set"):
            PromptStream(edited, seed=1, source="--prompt-data p.jsonl").load_state_dict(state)
    # A checkpoint from before the fingerprint: only the size is checked.
    old = {k: v for k, v in state.items() if k != "sha256"}
    PromptStream([PromptRecord("x"), *records[1:]], seed=1).load_state_dict(old)
