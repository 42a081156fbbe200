"""TokenizedDataModule: the user's text in their own tokenizer's ids, any vocabulary, written once, memory-mapped."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lit_efficient.data import TokenizedDataModule  # noqa: E402
from lit_efficient.data.loading import ResumableLoader  # noqa: E402


@pytest.fixture
def texts(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("def main():\n    return 1\n" * 200)
    (folder / "b.md").write_text("# notes\nsome words, some more words\n" * 200)
    (folder / "skip.bin").write_bytes(b"\x00\x01")  # not a text suffix
    return folder


def test_tokenizes_each_file_with_the_end_of_text_between_and_reuses_the_file(texts, demo_model, tmp_path):
    data = TokenizedDataModule(str(demo_model), path=str(texts), block_size=16, batch_size=2, cache_dir=str(tmp_path))
    data.prepare_data()
    target = data.token_file
    assert target.name.endswith(".uint16.bin") and target.exists()
    tok = data.tokenizer
    want = []
    for name in ("a.txt", "b.md"):
        want += tok((texts / name).read_text(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert data.tokens.tolist() == want and isinstance(data.tokens, np.memmap)
    assert data.vocab_size == len(tok)
    written = target.stat().st_mtime_ns
    again = TokenizedDataModule(str(demo_model), path=str(texts), block_size=16, batch_size=2, cache_dir=str(tmp_path))
    again.prepare_data()
    assert again.token_file == target and target.stat().st_mtime_ns == written  # the same inputs: not rewritten
    (texts / "a.txt").write_text("changed\n" * 300)
    changed = TokenizedDataModule(str(demo_model), path=str(texts), block_size=16, cache_dir=str(tmp_path))
    assert changed.token_file != target  # a changed file writes another token file


def test_a_vocabulary_above_65536_ids_is_stored_wide(texts, demo_model, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(str(demo_model))
    tok.add_tokens([f"<x{i}>" for i in range(70_000)])
    (texts / "c.txt").write_text("x <x69999> y <x5> " * 100)
    data = TokenizedDataModule(tok, path=str(texts), block_size=16, batch_size=2, cache_dir=str(tmp_path))
    data.setup("fit")  # outside a Trainer: setup writes the file itself
    assert data.token_file.name.endswith(".uint32.bin") and data.tokens.dtype == np.dtype("<u4")
    assert data.vocab_size == len(tok) > 65_536
    assert int(data.tokens.max()) == tok.convert_tokens_to_ids("<x69999>") > 65_535
    x, y = next(iter(data.train_dataloader()))
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert isinstance(data.train_dataloader(), ResumableLoader)


def test_mistakes_are_refused_with_the_fix(tmp_path, demo_model):
    with pytest.raises(ValueError, match="no such folder. Nothing is downloaded: save the tokenizer"):
        TokenizedDataModule("Qwen/Qwen2.5-0.5B")
    (tmp_path / "t.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match=r"a \.bin is already token ids; read it with TextDataModule"):
        TokenizedDataModule(str(demo_model), path=str(tmp_path / "t.bin"))
    missing = (
        r"^TokenizedDataModule\(path='.*missing'\): no such file or folder; give an existing text file, folder, or"
    )
    with pytest.raises(ValueError, match=missing):  # it was named TextDataModule, and offered a .bin it refuses
        TokenizedDataModule(str(demo_model), path=str(tmp_path / "missing"))
    (tmp_path / "no_tokenizer").mkdir()  # transformers said "You need to have sentencepiece or tiktoken installed"
    with pytest.raises(ValueError, match=r"no_tokenizer'\) holds no saved tokenizer .*tokenizer.save_pretrained"):
        TokenizedDataModule(str(tmp_path / "no_tokenizer"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text file"):
        TokenizedDataModule(str(demo_model), path=str(tmp_path / "empty"), cache_dir=str(tmp_path)).prepare_data()
    (tmp_path / "short.txt").write_text("a few words")  # said "TextDataModule: ... 3 bytes", of a token count
    short = TokenizedDataModule(
        str(demo_model), path=str(tmp_path / "short.txt"), block_size=8, cache_dir=str(tmp_path)
    )
    short.prepare_data()
    with pytest.raises(ValueError, match=r"^TokenizedDataModule: the (training|validation) split has \d+ tokens"):
        short.setup("fit")


def test_text_that_is_not_utf8_is_named_and_a_bom_or_a_cut_character_is_no_token(demo_model, tmp_path):
    """Invalid bytes became U+FFFD tokens without a word (a Latin-1 file), a byte-order mark a token at the
    document's start, and a character that max_bytes cut a U+FFFD token (a user audit)."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a_latin1.txt").write_bytes("caf\xe9 na\xefve\n".encode("latin-1"))
    (folder / "b_bom.txt").write_bytes(b"\xef\xbb\xbfhello\n")
    (folder / "c_cut.txt").write_bytes(b"\xef\xbb\xbf" + "d\u00e9j\u00e0".encode())  # the cap cuts its last character
    cap = sum(len(p.read_bytes()) for p in folder.iterdir()) - 1
    data = TokenizedDataModule(str(demo_model), path=str(folder), block_size=4, max_bytes=cap, cache_dir=str(tmp_path))
    said = r"1 file\(s\) are not UTF-8 text \(.*a_latin1\.txt\): their invalid bytes"
    with pytest.warns(UserWarning, match=said):
        text = data.tokenizer.decode(data.tokens.tolist())
    assert text.count("\ufffd") == 2 and "\ufeff" not in text and "hello" in text and "d\u00e9j" in text
    # A later run reusing the token file says it again: it was said only by the run that wrote the file.
    again = TokenizedDataModule(str(demo_model), path=str(folder), block_size=4, max_bytes=cap, cache_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=said):
        assert again.tokens.tolist() == data.tokens.tolist()
    (folder / "a_latin1.txt").write_text("caf\u00e9\n")  # converted: a new token file, nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = TokenizedDataModule(str(demo_model), path=str(folder), max_bytes=cap, cache_dir=str(tmp_path))
        assert converted.tokenizer.decode(converted.tokens.tolist()).count("\ufffd") == 0


def test_a_tokenizer_saved_again_with_another_pipeline_tokenizes_again(texts, demo_model, tmp_path):
    """The cache key held the vocabulary and special tokens only: the same vocabulary saved with a lowercasing
    normalizer reused the old ids, which that tokenizer no longer makes (a data audit)."""
    from tokenizers import normalizers

    # A generic fast tokenizer, whose tokenizer.json is its whole definition (Qwen2Tokenizer rebuilds its own
    # pipeline from the vocabulary and merges on load: a saved normalizer does not change its ids).
    demo = transformers.AutoTokenizer.from_pretrained(str(demo_model)).backend_tokenizer
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=demo, eos_token="<|endoftext|>")
    eos = tok.eos_token_id
    (texts / "c.txt").write_text("The Quick Brown Fox\n" * 50)  # capitals: the lowercasing changes its ids
    folder = tmp_path / "tok"
    tok.save_pretrained(folder)
    before = TokenizedDataModule(str(folder), path=str(texts), block_size=16, cache_dir=str(tmp_path))
    before.prepare_data()
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    tok.save_pretrained(folder)  # the same folder, the same vocabulary
    after = TokenizedDataModule(str(folder), path=str(texts), block_size=16, cache_dir=str(tmp_path))
    assert sorted(after.tokenizer.get_vocab().items()) == sorted(before.tokenizer.get_vocab().items())
    assert after.token_file != before.token_file
    want = []
    for name in ("a.txt", "b.md", "c.txt"):
        want += after.tokenizer((texts / name).read_text(), add_special_tokens=False)["input_ids"] + [eos]
    assert after.tokens.tolist() == want != before.tokens.tolist()
    # A call's truncation or padding settings are no new pipeline: the same token file (a used object re-tokenized).
    used = transformers.AutoTokenizer.from_pretrained(str(folder))
    used("some text " * 50, truncation=True, max_length=8)
    assert (
        TokenizedDataModule(used, path=str(texts), block_size=16, cache_dir=str(tmp_path)).token_file
        == after.token_file
    )


def test_a_token_file_that_cannot_be_written_leaves_no_partial_file_and_names_the_fix(
    texts, demo_model, tmp_path, monkeypatch
):
    """A full disk said only "27000 requested and 8192 written" and left a .partial file per try (a data audit)."""
    import errno

    data = TokenizedDataModule(str(demo_model), path=str(texts), block_size=16, cache_dir=str(tmp_path / "cache"))
    written = []

    def disk_fills_up(out_path):
        out_path.write_bytes(b"\x00" * 8192)  # some ids made it to disk before it filled up
        written.append(out_path)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data, "_write_tokens", disk_fills_up)
    with pytest.raises(OSError, match=r"could not write its token file .*tokens-.*\.bin \(No space left on device\)\. "
                       r"Free space there, or point cache_dir .* or \$LIT_EFFICIENT_CACHE at") as raised:  # fmt: skip
        data.prepare_data()
    assert raised.value.errno == errno.ENOSPC and written[0].name.endswith(".partial")
    assert list((tmp_path / "cache").iterdir()) == []  # the partial file is gone; no token file

    def short_write(out_path):  # numpy's own short write: an OSError without an errno
        raise OSError("27000 requested and 8192 written")

    monkeypatch.setattr(data, "_write_tokens", short_write)
    with pytest.raises(OSError, match=r"^TokenizedDataModule could not write its token file .*\(27000 requested and "
                       r"8192 written\)\. Free space there"):  # fmt: skip  # it read "[Errno None] TokenizedDataModule"
        data.prepare_data()
    monkeypatch.undo()
    (tmp_path / "a_file").write_text("")
    in_a_file = TokenizedDataModule(str(demo_model), path=str(texts), cache_dir=str(tmp_path / "a_file"))
    with pytest.raises(OSError, match=r"could not write its token file .*a_file/tokens-"):  # not the partial's unlink
        in_a_file.prepare_data()
    data.prepare_data()  # room again: written whole
    assert len(data.tokens) > 0


def test_a_tokenizer_object_stays_out_of_the_checkpoint(texts, demo_model, tmp_path):
    """A tokenizer object went into the data module's hyper-parameters, pickled into every checkpoint, which
    torch.load's weights_only default then refused: HFCausalLM.load_from_checkpoint after fit raised an
    UnpicklingError (a data audit)."""
    from lightning.pytorch import Trainer

    from lit_efficient import PACIStrategy
    from lit_efficient.models import HFCausalLM

    tok = transformers.AutoTokenizer.from_pretrained(str(demo_model))
    data = TokenizedDataModule(tok, path=str(texts), block_size=16, batch_size=2, cache_dir=str(tmp_path))
    assert "tokenizer" not in data.hparams and data.hparams["block_size"] == 16
    assert "tokenizer" not in data.hparams_initial
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, strategy=PACIStrategy(pipeline_stages=2), limit_val_batches=2,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(HFCausalLM(str(demo_model)), datamodule=data)
    trainer.save_checkpoint(tmp_path / "fit.ckpt")
    assert torch.load(tmp_path / "fit.ckpt")["datamodule_hyper_parameters"]["path"] == str(texts)  # weights_only
    HFCausalLM.load_from_checkpoint(tmp_path / "fit.ckpt")
    by_folder = TokenizedDataModule(str(demo_model), path=str(texts), block_size=16, cache_dir=str(tmp_path))
    assert by_folder.hparams["tokenizer"] == str(demo_model)  # a path is kept: the CLI's config names it
    by_path = TokenizedDataModule(demo_model, path=texts, block_size=16, cache_dir=tmp_path)  # pathlib.Paths
    assert by_path.hparams["tokenizer"] == str(demo_model) and by_path.hparams["path"] == str(texts)  # not a Path
    assert by_path.hparams["cache_dir"] == str(tmp_path)  # missed by the per-argument conversion (the re-read)


def test_a_cap_that_cuts_the_text_says_how_much_it_kept(texts, demo_model, tmp_path, caplog):
    """max_bytes (8 MB by default) cut a user's corpus without a word: the rest was never trained on."""
    total = sum(p.stat().st_size for p in texts.glob("*.*") if p.suffix != ".bin")  # a.txt and b.md: 12,200
    data = TokenizedDataModule(
        str(demo_model), path=str(texts), block_size=16, max_bytes=6_000, cache_dir=str(tmp_path)
    )
    with pytest.warns(UserWarning, match=rf"text capped at max_bytes=6,000 bytes of {total:,} \(49\.2%\); the rest "
                      r"is not tokenized\. Set max_bytes=None"):  # fmt: skip
        assert len(data.tokens) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole text: nothing to say of the cap
        warnings.filterwarnings("ignore", message=r".*1 other file\(s\) are not read \(skip\.bin\)")
        whole = TokenizedDataModule(str(demo_model), path=str(texts), max_bytes=total, cache_dir=str(tmp_path))
        assert len(whole.tokens) > len(data.tokens)
    with caplog.at_level(logging.INFO):  # the embedded corpus is cut by design: a log line, not a warning
        assert len(TokenizedDataModule(str(demo_model), max_bytes=2_000, cache_dir=str(tmp_path)).tokens) > 0
    assert "text capped at max_bytes=2,000 bytes of" in caplog.text
