"""TextDataModule: the embedded corpus, user files/folders/.bin, the split, the blocks, and its errors."""

from __future__ import annotations

import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_efficient.data import TextDataModule
from lit_efficient.tools.corpus import concat_files, embedded_corpus, stdlib_files


def test_embedded_corpus_is_real_deterministic_text():
    files = stdlib_files()
    assert files and all(f.suffix == ".py" for f in files)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(root).parts) for f in files)
    first, second = concat_files(files, 50_000), concat_files(stdlib_files(), 50_000)
    assert first == second and len(first) == 50_000
    assert first.startswith(files[0].read_bytes()[:100])
    assert b"def " in first and b"import " in first
    data = TextDataModule(max_bytes=50_000)
    assert data.vocab_size == 256
    assert bytes(data.tokens) == embedded_corpus(50_000) == first


def test_the_corpus_walk_reads_the_stdlib_in_the_order_of_its_relative_paths():
    """The walk stops at the corpus' last byte instead of listing the whole stdlib first (a second per rank); its
    order is still the relative paths' sorted order, which fixes every run's data ("a-b/" < "a.py" < "a/")."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    listed = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts[:-1])]
    assert stdlib_files() == sorted(listed, key=lambda p: p.relative_to(root).as_posix())


def test_split_sizes_follow_val_fraction(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 4)  # 1024 bytes
    data = TextDataModule(str(path), block_size=9, batch_size=2, val_fraction=0.25)
    assert data.split_sizes() == (768, 256)
    data.setup("fit")
    assert len(data.train_set) == 768 // 10 and len(data.val_set) == 256 // 10
    # Validation is the tail: its first block starts right after the training split.
    x, y = data.val_set[0]
    assert x.tolist() == list(range(0, 9)) and y.tolist() == list(range(1, 10))  # 768 % 256 == 0


def test_blocks_are_shifted_by_one_and_int64(tmp_path):
    path = tmp_path / "t.txt"
    text = b"the quick brown fox jumps over the lazy dog. " * 20
    path.write_bytes(text)
    data = TextDataModule(str(path), block_size=8, batch_size=4, val_fraction=0.1)
    data.setup("fit")
    for i in (0, 3):
        x, y = data.train_set[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
        assert torch.equal(x[1:], y[:-1])
        assert bytes(x.tolist()) + bytes(y[-1:].tolist()) == text[i * 9 : i * 9 + 9]
    with pytest.raises(IndexError):
        data.train_set[len(data.train_set)]


def test_train_loader_shuffles_by_seed_and_val_loader_does_not(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 8)
    batches = []
    for seed in (1, 1, 2):
        data = TextDataModule(str(path), block_size=7, batch_size=4, seed=seed)
        data.setup("fit")
        batches.append(next(iter(data.train_dataloader()))[0])
    assert torch.equal(batches[0], batches[1]) and not torch.equal(batches[0], batches[2])
    loader = data.train_dataloader()
    assert len(loader) == len(data.train_set) // 4  # incomplete batch dropped
    val_x = next(iter(data.val_dataloader()))[0]
    assert torch.equal(val_x[0], data.val_set[0][0])
    assert torch.equal(next(iter(data.test_dataloader()))[0], val_x)
    assert torch.equal(next(iter(data.predict_dataloader()))[0], val_x)


def test_folder_reads_text_files_sorted_and_skips_others(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.md").write_text("two")
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "c.py").write_text("three")
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".hidden.txt").write_text("secret")
    data = TextDataModule(str(tmp_path), block_size=2, batch_size=1)
    assert bytes(data.tokens) == b"one\ntwo\nthree\n"


def test_max_bytes_caps_text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"x" * 1000)
    # A user's text cut is warned about with how much (it was an INFO line without the total, also when nothing
    # was cut: a 1,000-byte file under max_bytes=1000).
    with pytest.warns(UserWarning, match=r"capped at max_bytes=300 bytes of 1,000 \(30\.0%\); the rest is not"):
        assert len(TextDataModule(str(path), max_bytes=300).tokens) == 300
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(TextDataModule(str(path), max_bytes=1000).tokens) == 1000
    assert len(TextDataModule(str(path), max_bytes=None).tokens) == 1000


def test_bin_tokens_are_memory_mapped_with_their_vocabulary(tmp_path):
    path = tmp_path / "train.bin"
    ids = (np.arange(2000) * 7 % 300).astype(np.uint16)
    ids.tofile(path)
    data = TextDataModule(str(path), block_size=16, batch_size=4)
    assert data.vocab_size == 300
    assert isinstance(data.tokens, np.memmap) and np.array_equal(data.tokens, ids)
    data.setup("fit")
    x, y = next(iter(data.val_dataloader()))
    assert x.dtype == torch.int64 and x.max() < 300
    assert TextDataModule(str(path), vocab_size=50257).vocab_size == 50257


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(block_size=0), "block_size=0"),
        (dict(batch_size=0), "batch_size=0"),
        (dict(num_workers=-1), "num_workers=-1"),
        (dict(val_fraction=0.0), "val_fraction=0.0"),
        (dict(val_fraction=1.0), "val_fraction=1.0"),
        (dict(max_bytes=0), "max_bytes=0"),
        (dict(vocab_size=100), "vocab_size=100"),
        (dict(path="/no/such/file.txt"), "no such file"),
        (dict(block_size=2.5), r"block_size=2\.5\) must be an integer >= 1"),  # crashed in setup
        (dict(seed="x"), r"seed='x'\) must be an integer"),  # crashed in the loader
        (dict(val_fraction="0.1"), r"val_fraction='0\.1'\) must be a number in \(0, 1\)"),
        (dict(max_bytes=1.5), r"max_bytes=1\.5\) must be an integer >= 1"),  # a TypeError from slicing
        (dict(num_workers="2"), r"num_workers='2'\) must be an integer >= 0"),  # a TypeError from <
        (dict(path=""), r"path=''\) must be the path of a text file"),  # read as '.', "holds no text file" in setup
        (dict(path=3), r"path=3\) must be the path of a text file"),  # a TypeError from Path()
        (dict(vocab_size="2"), r"vocab_size='2'\) must be an integer"),  # a TypeError from <
        (dict(vocab_size=300.0), r"vocab_size=300\.0\) must be an integer"),  # taken, and saved as a float
        (dict(vocab_size=0), r"vocab_size=0\) must be an integer >= 1"),  # said "an integer": 0 is one
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TextDataModule(**kwargs)


def test_a_numpy_seed_it_takes_draws_its_epochs():
    """TextDataModule takes any integer seed; EpochShuffle's own check refused a numpy one at the first epoch (a
    re-read of the change that added the check), after the construction had taken it."""
    import numpy as np

    from lit_efficient.data import EpochShuffle

    data = TextDataModule(block_size=16, batch_size=2, max_bytes=4000, seed=np.int64(3))
    data.setup("fit")
    drawn = [x for x, _ in data.train_dataloader()]
    assert len(drawn) > 1 and list(EpochShuffle(np.int64(9), seed=np.int64(3))) == list(EpochShuffle(9, seed=3))
    with pytest.raises(ValueError, match=r"EpochShuffle\(seed=2\.5\) must be an integer"):
        EpochShuffle(9, seed=2.5)


def test_input_errors_say_what_to_change(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        TextDataModule(str(empty)).setup("fit")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="no text file"):
        TextDataModule(str(tmp_path / "folder")).setup("fit")
    short = tmp_path / "short.txt"
    short.write_bytes(b"a" * 100)
    with pytest.raises(ValueError, match=r"validation split has 5 bytes .* block_size \+ 1 = 9"):
        TextDataModule(str(short), block_size=8, batch_size=1).setup("fit")
    with pytest.raises(ValueError, match=r"training split has 95 bytes .* lower block_size"):
        TextDataModule(str(short), block_size=99, batch_size=1, val_fraction=0.05).setup("fit")
    with pytest.raises(ValueError, match="fewer than batch_size=64"):
        TextDataModule(str(short), block_size=4, batch_size=64, val_fraction=0.1).setup("fit")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="whole number of uint16"):
        TextDataModule(str(odd)).setup("fit")
    with pytest.raises(RuntimeError, match="setup"):
        TextDataModule(str(short)).train_dataloader()


def test_token_files_are_read_in_the_dtype_their_name_says(tmp_path):
    """Every .bin was read as uint16: a uint32 token file (TokenizedDataModule's for a vocabulary above 65,536 ids,
    the .bin that TokenizedDataModule's refusal sends to TextDataModule) trained on garbage, silently."""
    ids = (np.arange(3000) * 7919 % 100_000).astype("<u4")
    ids.tofile(tmp_path / "tokens.uint32.bin")
    wide = TextDataModule(str(tmp_path / "tokens.uint32.bin"), block_size=16, batch_size=2)
    assert wide.tokens.dtype == np.dtype("<u4") and np.array_equal(wide.tokens, ids)
    assert wide.vocab_size == int(ids.max()) + 1 > 65_536
    wide.setup("fit")
    x, y = next(iter(wide.val_dataloader()))
    assert x.max() > 65_535 and torch.equal(x[:, 1:], y[:, :-1])
    ids.astype("<u2").tofile(tmp_path / "tokens.uint16.bin")
    assert TextDataModule(str(tmp_path / "tokens.uint16.bin")).tokens.dtype == np.dtype("<u2")
    (tmp_path / "odd.uint32.bin").write_bytes(b"\x00" * 6)
    with pytest.raises(ValueError, match="whole number of uint32 tokens"):
        TextDataModule(str(tmp_path / "odd.uint32.bin")).setup("fit")


def test_a_plain_bin_with_a_vocabulary_above_uint16_is_refused_naming_the_rename(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(100, dtype="<u4").tofile(path)
    with pytest.raises(ValueError, match=r"vocab_size=128256\): a plain \.bin is read as nanoGPT's uint16 ids.*"
                       r"Name the file by its dtype: train\.uint32\.bin if it holds uint32 ids"):  # fmt: skip
        TextDataModule(str(path), vocab_size=128_256)
    TextDataModule(str(path), vocab_size=65_536)  # every uint16 id: no ambiguity


def test_a_token_id_not_below_the_given_vocabulary_is_named_where_blocks_are_read(tmp_path):
    """A uint32 file named .bin, or a vocab_size too small, gave an IndexError (a device-side assert on GPU) in the
    model's embedding, far from the file."""
    path = tmp_path / "train.bin"
    ids = np.arange(2000, dtype="<u2") % 300
    ids[1234] = 40_000
    ids.tofile(path)
    data = TextDataModule(str(path), block_size=16, batch_size=4, vocab_size=300)
    data.setup("fit")
    block = 1234 // 17
    with pytest.raises(ValueError, match=rf"token id 40000 \(block {block}, position {1234 - 17 * block}\) of "
                       rf".*train\.bin is not below vocab_size=300\. Pass the vocabulary"):  # fmt: skip
        data.train_set[block]
    assert data.train_set[0][0].max() < 300  # the other blocks read as before


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_of_records_is_read_as_text_with_a_warning(tmp_path, suffix):
    """A .jsonl path was tokenized as raw text, keys, quotes and braces included, without a word (a data audit)."""
    path = tmp_path / f"data{suffix}"
    path.write_text('{"text": "hello world"}\n' * 500)
    said = rf"data{suffix}'\) is read as plain text, its \{suffix} markup \(or binary bytes\) included: this module "
    with pytest.warns(UserWarning, match=said + r"does not parse records\. Write each record's text to a \.txt file"):
        data = TextDataModule(str(path), block_size=16, batch_size=2)
    assert bytes(data.tokens[:9]) == b'{"text": '


def test_a_folders_files_that_are_not_read_are_named(tmp_path):
    """A .jsonl among a folder's .txt files was dropped without a word (a user audit)."""
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("some text\n" * 300)
    (folder / "sub" / "extra.jsonl").write_text('{"text": "more"}\n')
    (folder / ".hidden.json").write_text("{}")  # hidden: skipped by design, not named
    with pytest.warns(UserWarning, match=r"reads only \.txt, \.md, \.rst, \.py files: 1 other file\(s\) are not read "
                      r"\(sub/extra\.jsonl\)\. Rename text files"):  # fmt: skip
        data = TextDataModule(str(folder), block_size=16, batch_size=2)
    assert bytes(data.tokens[:9]) == b"some text"
    (folder / "sub" / "extra.jsonl").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TextDataModule(str(folder), block_size=16, batch_size=2)
