"""boost_jax.data.prepare: the ids it writes, its sources, its metadata checks and its BPE
(tests/e2e/test_prepare_memory.py: its memory, which must not grow with the corpus)."""

import json

import numpy as np
import pytest

from boost_jax.data.prepare import prepare
from boost_jax.data.sources import load_corpus
from boost_jax.data.token_bin import read_meta
from boost_jax.data.tokenizers import ByteTokenizer, HFTokenizer, train_bpe
from boost_jax.config import DataConfig
from boost_jax.errors import UserError

DOCS = [f"document {i}: " + "héllo wörld → " * (i % 7 + 1) + "\n" for i in range(300)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bpe") / "tokenizer.json")
    train_bpe(DOCS * 3, 600, save_path=path)
    return path


def _expected(tok, docs):
    return np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs])


def test_jsonl_ids_are_the_documents_then_eos(tmp_path, bpe):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    for spec, workers in (("byte", 1), (bpe, 2)):
        out = str(tmp_path / f"c{workers}.bin")
        meta = prepare(str(src), out, spec, workers=workers, progress=False, task_bytes=2000)
        tok = ByteTokenizer() if spec == "byte" else HFTokenizer.from_file(spec)
        ids = np.fromfile(out, dtype=meta["dtype"])
        assert np.array_equal(ids, _expected(tok, DOCS))
        assert meta["n_documents"] == len(DOCS) and meta["n_tokens"] == len(ids)
        assert meta["max_id"] == ids.max() and read_meta(out)["tokenizer_fingerprint"] == \
            tok.fingerprint


def test_text_file_is_one_document_whatever_the_pieces(tmp_path, monkeypatch):
    from boost_jax.data import prepare as prep

    text = "".join(DOCS) + "no newline at the end: ü"
    (tmp_path / "t.txt").write_text(text)
    monkeypatch.setattr(prep, "PIECE", 37)  # pieces cut after line breaks / characters
    meta = prepare(str(tmp_path / "t.txt"), str(tmp_path / "t.bin"), "byte", 1, progress=False,
                   task_bytes=100)
    ids = np.fromfile(tmp_path / "t.bin", dtype=np.uint16)
    assert np.array_equal(ids, _expected(ByteTokenizer(), [text])) and meta["n_documents"] == 1
    line = "é" * 40  # no line break at all: pieces end on character boundaries
    (tmp_path / "u.txt").write_text(line)
    prepare(str(tmp_path / "u.txt"), str(tmp_path / "u.bin"), "byte", 1, progress=False)
    assert np.fromfile(tmp_path / "u.bin", np.uint16).tobytes() == \
        np.append(np.frombuffer(line.encode(), np.uint8), 0).astype(np.uint16).tobytes()


def test_parquet_and_saved_hf_dataset(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(DOCS))), "content": DOCS})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=70)
    ds = tmp_path / "saved_ds"  # the layout datasets' save_to_disk writes
    ds.mkdir()
    (ds / "dataset_info.json").write_text("{}")
    with pa.ipc.new_stream(str(ds / "data-00000-of-00001.arrow"), table.schema) as w:
        for batch in table.to_batches(max_chunksize=50):
            w.write_batch(batch)
    want = _expected(ByteTokenizer(), DOCS)
    for src in (tmp_path / "c.parquet", ds):
        out = str(tmp_path / f"{src.name}.bin")
        prepare(str(src), out, "byte", 2, field="content", progress=False)
        assert np.array_equal(np.fromfile(out, np.uint16), want)
    with pytest.raises(UserError, match=r"has no column 'text' \(columns: \['id', 'content'\]\)"):
        prepare(str(tmp_path / "c.parquet"), str(tmp_path / "x.bin"), "byte", 1, progress=False)
    # a dictionary-encoded text column (pandas' categoricals) is text
    pq.write_table(pa.table({"text": pa.array(DOCS).dictionary_encode()}), tmp_path / "d.parquet")
    prepare(str(tmp_path / "d.parquet"), str(tmp_path / "d.bin"), "byte", 1, progress=False)
    assert np.array_equal(np.fromfile(tmp_path / "d.bin", np.uint16), want)
    # a list column beside text files would add one empty document a row
    pq.write_table(pa.table({"text": [["a list"]] * 4}), tmp_path / "l.parquet")
    with pytest.raises(UserError, match=r"^SOURCE file '.*l\.parquet' column 'text' holds "
                                        r"list<element: string>, not text"):
        prepare(str(tmp_path / "l.parquet"), str(tmp_path / "y.bin"), "byte", 1, progress=False)


def test_training_checks_the_metadata(tmp_path, bpe):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 4))
    out = str(tmp_path / "c.bin")
    prepare(str(src), out, bpe, 1, progress=False)
    cfg = DataConfig(source=out, tokenizer=bpe, max_bytes=None, val_fraction=0.1)
    corpus = load_corpus(cfg)
    assert isinstance(corpus.train, np.memmap) and len(corpus.train) + len(corpus.val) == \
        read_meta(out)["n_tokens"]
    with pytest.raises(UserError, match=r"was tokenized with '.*', another tokenizer than this "
                                        r"run's 'byte'; set data\.tokenizer="):
        load_corpus(DataConfig(source=out, tokenizer="byte", max_bytes=None))
    with pytest.raises(UserError, match=r"holds uint16 ids .* but data\.bin_dtype=uint32; set "
                                        r"data\.bin_dtype=uint16"):
        load_corpus(DataConfig(source=out, tokenizer=bpe, bin_dtype="uint32", max_bytes=None))
    with open(out, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(UserError, match=r"changed after prepare"):
        load_corpus(DataConfig(source=out, tokenizer=bpe, max_bytes=1 << 30))


def test_tokenizer_bpe_trains_saves_and_names_it(tmp_path, capsys):
    """--tokenizer bpe: a BPE trained on SOURCE lands next to OUT, the ids are its ids, the
    printed train line names it and training accepts the pair."""
    from boost_jax.data.prepare import main

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 2))
    out = str(tmp_path / "data" / "c.bin")
    argv = [str(src), out, "--tokenizer", "bpe", "--bpe-vocab-size", "600", "--workers", "1",
            "--no-progress"]
    assert main(argv) == 0
    tok_path = str(tmp_path / "data" / "c.tokenizer.json")
    printed = capsys.readouterr().out
    assert " tokens/s, 1 worker); metadata in " in printed
    assert f"data.tokenizer={tok_path} " in printed and f": {tok_path}\n" in printed
    tok = HFTokenizer.from_file(tok_path)
    assert 512 < tok.vocab_size <= 600 and tok.eos_id == 0  # a small corpus may stop short
    assert np.array_equal(np.fromfile(out, np.uint16), _expected(tok, DOCS * 2))
    assert read_meta(out)["tokenizer"] == tok_path
    corpus = load_corpus(DataConfig(source=out, tokenizer=tok_path, max_bytes=None))
    assert len(corpus.train) + len(corpus.val) == read_meta(out)["n_tokens"]
    with pytest.raises(SystemExit) as e:  # all three exist: one line, nothing replaced
        main(argv)
    assert e.value.code == 2
    assert "c.tokenizer.json' already exist" in capsys.readouterr().err
    before = open(tok_path).read()
    with pytest.raises(SystemExit) as e:  # the flag it came from, not the config key
        main(argv + ["--force", "--bpe-vocab-size", "100"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: --bpe-vocab-size 100 is too small ")
    assert main(argv + ["--force", "--bpe-vocab-size", "520"]) == 0
    assert open(tok_path).read() != before and HFTokenizer.from_file(tok_path).vocab_size == 520


CODE = "".join(f"def f{i}(x):\n    if x:\n        return {i}\n    return x  \nX{i} = f{i}(1)\n"
               for i in range(80))


def test_text_pieces_encode_as_the_whole_file_with_a_bpe(tmp_path, monkeypatch):
    """A BPE that learned indentation merges (a line break with the spaces after it) gives the
    whole file's ids however small the pieces: they end only between non-space characters."""
    from boost_jax.data import prepare as prep

    path = str(tmp_path / "bpe.json")
    train_bpe([CODE] * 4, 600, save_path=path)
    tok = HFTokenizer.from_file(path)
    monkeypatch.setattr(prep, "PIECE", 64)
    cjk = "".join(f"文本{i}\n    缩进 {i}\n" for i in range(60))
    for name, text in (("lf", CODE), ("crlf", CODE.replace("\n", "\r\n")), ("cjk", cjk)):
        (tmp_path / f"{name}.txt").write_bytes(text.encode())
        prepare(str(tmp_path / f"{name}.txt"), str(tmp_path / f"{name}.bin"), path, 1,
                progress=False, task_bytes=200)
        ids = np.fromfile(tmp_path / f"{name}.bin", dtype=np.uint16)
        assert np.array_equal(ids, _expected(tok, [text])), name


def test_a_dataset_download_is_read_for_its_shards_not_its_card(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    dl = tmp_path / "download"
    (dl / "data").mkdir(parents=True)
    pq.write_table(pa.table({"text": DOCS[:5]}), dl / "data" / "train-0.parquet")
    (dl / "README.md").write_text("---\nlicense: mit\n---\n# the dataset card\n")
    (dl / "loader.py").write_text("import datasets\n")
    meta = prepare(str(dl), str(tmp_path / "out.bin"), "byte", 1, progress=False)
    assert meta["n_documents"] == 5
    assert np.array_equal(np.fromfile(tmp_path / "out.bin", np.uint16),
                          _expected(ByteTokenizer(), DOCS[:5]))
