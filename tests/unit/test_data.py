"""Data package: tokenizers, sources, split, grain pipeline determinism/resume/sharding, errors."""

import json
import os

import numpy as np
import pytest

from boost_jax.config import Config, DataConfig
from boost_jax.data import (ByteTokenizer, HFTokenizer, build_data, get_tokenizer, load_corpus,
                            make_eval_batches, make_train_iterator, read_documents,
                            split_documents, train_bpe)
from boost_jax.data.sources import in_val
from boost_jax.errors import UserError

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def _text(i: int, n_words: int = 300) -> str:
    rng = np.random.default_rng(i)
    lines = [" ".join(rng.choice(WORDS, 10)) for _ in range(n_words // 10)]
    return f"# doc {i}\n" + "\n".join(lines) + "\n"


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub" / "deeper").mkdir(parents=True)
    for i in range(40):
        ext = (".txt", ".py", ".md")[i % 3]
        sub = ("", "sub", "sub/deeper")[i % 3]
        (d / sub / f"f{i:02d}{ext}").write_text(_text(i))
    (d / "ignored.bin").write_bytes(b"\x01\x02")
    return d


def _cfg(source, **kw) -> DataConfig:
    kw.setdefault("max_bytes", None)
    return DataConfig(source=str(source), **kw)


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo wörld → ∑ 😀\nline two"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < tok.vocab_size == 256
    assert tok.decode(ids) == text
    joined = tok.encode_documents(["ab", "cd"])
    assert joined.tolist() == [97, 98, tok.eos_id, 99, 100] and tok.eos_id == 0
    assert tok.decode(joined) == "abcd"  # decode drops EOS


def test_evaluate_counts_each_byte_once_where_windows_split_a_character():
    """bits per byte divides by the bytes the targets spell: per id for byte-level BPE, so a
    3-byte character split between two windows counts 3 bytes, not two U+FFFD of 3 each."""
    from boost_jax.evaluate import target_bytes

    text = "".join(chr(0x4E00 + i * 7919 % 2000) for i in range(3000))  # 3 bytes each
    tok = train_bpe([text], 600)
    ids = tok.encode(text)
    cut = len(ids) // 7 * 7
    rows = ids[:cut].reshape(-1, 7)
    decoded = sum(len(tok.decode(r).encode()) for r in rows)
    assert decoded > len(text.encode())  # what decoding each window alone counts
    assert target_bytes(tok, rows) + target_bytes(tok, ids[None, cut:]) == len(text.encode())
    eos = np.array([[5, 0, 7]])  # document breaks count none
    assert target_bytes(ByteTokenizer(), eos) == 2
    assert target_bytes(tok, np.array([[tok.eos_id]])) == 0


def test_bpe_words_are_cut_so_one_long_line_trains_like_short_ones():
    """A line of one script with no spaces is one pre-tokenizer word, which the trainer's time
    grows with the square of (a 200 KB line took minutes): words are cut at BPE_MAX_WORD
    bytes, so no token is longer, and every text still round-trips."""
    from boost_jax.data.tokenizers import BPE_MAX_WORD

    long_line = "日本語テキスト" * 4000 + "x" * 50_000  # 134 KB, no space
    tok = train_bpe(["hello world " * 200, long_line], 600)
    vocab = tok._tok.get_vocab()
    assert max(len(t) for t in vocab if t != "<|endoftext|>") <= BPE_MAX_WORD  # 1 char = 1 byte
    for text in (long_line, "héllo wörld  日本語 " + "y" * 200 + "\n\tz"):
        assert tok.decode(tok.encode(text)) == text


def test_bpe_train_cache_and_reload(tmp_path):
    texts = [_text(i) for i in range(30)]
    calls = []

    def corpus():
        calls.append(1)
        return texts

    cfg = DataConfig(tokenizer="bpe", bpe_vocab_size=512)
    tok = get_tokenizer(cfg, corpus, str(tmp_path))
    assert calls == [1] and (tmp_path / "tokenizer.json").is_file()
    assert 257 <= tok.vocab_size <= 512 and tok.eos_id == 0
    ids = tok.encode(texts[3])
    assert len(ids) < len(texts[3]) / 2  # merges learnt on this vocabulary compress it
    assert tok.decode(ids) == texts[3]
    before = os.stat(tmp_path / "tokenizer.json").st_mtime_ns
    tok2 = get_tokenizer(cfg, corpus, str(tmp_path))  # resumed run: reuse, no retraining
    assert os.stat(tmp_path / "tokenizer.json").st_mtime_ns == before
    assert np.array_equal(tok2.encode(texts[3]), ids) and tok2.vocab_size == tok.vocab_size
    docs = tok2.encode_documents(texts[:2])
    assert (docs == tok2.eos_id).sum() == 1


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path / "wl.json"
    wl = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    wl.save(str(path))
    tok = get_tokenizer(DataConfig(tokenizer=str(path)), list, None)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world foo").tolist() == [1, 2, 0]
    assert tok.eos_id == 3 and tok.vocab_size == 4  # no EOS in the file: one is added
    # a trained BPE file loads as a plain path too, keeping its own EOS
    train_bpe([_text(i) for i in range(5)], 512, str(tmp_path / "b" / "tokenizer.json"))
    tok2 = HFTokenizer.from_file(str(tmp_path / "b" / "tokenizer.json"))
    assert tok2.eos_id == 0 and tok2.vocab_size <= 512
    # ids with gaps: the embedding needs a row for the largest (15 tokens, EOS numbered 1000
    # trained a 128-row model on ids up to 1000)
    sparse = tmp_path / "sparse.json"
    vocab = {"[UNK]": 0, "hello": 5, "world": 9, "<|endoftext|>": 1000}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(sparse))
    tok3 = HFTokenizer.from_file(str(sparse))
    assert tok3.eos_id == 1000 and tok3.vocab_size == 1001


# --------------------------------------------------------------------------- sources


def test_text_file_source(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("".join(_text(i, 1000) for i in range(20)))  # ~150 KB → ~10 chunks
    c = load_corpus(_cfg(f, val_fraction=0.2))
    assert c.n_train_docs >= 1 and c.n_val_docs >= 1
    assert len(c.train) + len(c.val) == os.path.getsize(f) + c.n_train_docs + c.n_val_docs - 2
    capped = load_corpus(_cfg(f, max_bytes=10_000))
    assert len(capped.train) + len(capped.val) - (capped.n_train_docs + capped.n_val_docs - 2) \
        == 10_000


def test_folder_source(folder):
    docs = read_documents(str(folder), None)
    keys = [k for k, _ in docs]
    assert len(docs) == 40 and keys == sorted(keys) and "sub/deeper/f02.md" in keys
    assert docs == read_documents(str(folder), None)  # deterministic
    c = load_corpus(_cfg(folder))
    assert c.train.dtype == np.int32 and c.n_train_docs + c.n_val_docs == 40
    capped = read_documents(str(folder), 5000)
    assert sum(len(t.encode()) for _, t in capped) == 5000
    assert [k for k, _ in capped] == keys[: len(capped)]  # the cap keeps a sorted prefix


def test_a_folder_source_edited_in_place_is_read_again(folder):
    """The corpus cache of one process checks each file of a folder, not the folder's own
    mtime (which an edit in place leaves unchanged)."""
    before = load_corpus(_cfg(folder, val_fraction=0.5))
    assert load_corpus(_cfg(folder, val_fraction=0.5)) is before  # cached
    mtime = os.stat(folder).st_mtime_ns
    (folder / "sub" / "f01.py").write_text("x = 1\n" * 500)
    assert os.stat(folder).st_mtime_ns == mtime
    after = load_corpus(_cfg(folder, val_fraction=0.5))
    assert after is not before and len(after.train) + len(after.val) != \
        len(before.train) + len(before.val)


def test_jsonl_source(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"text": _text(i), "id": i}) for i in range(30)) + "\n\n")
    docs = read_documents(str(f), None)
    assert len(docs) == 30 and docs[4][1] == _text(4)
    c = load_corpus(_cfg(f))
    assert c.n_train_docs + c.n_val_docs == 30 and len(c.val) > 0


def test_bin_source(tmp_path, capsys):
    ids = (np.arange(10_000) % 1000).astype(np.uint16)
    f = tmp_path / "toks.bin"
    ids.tofile(f)
    path = tmp_path / "wl.json"
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0")).save(str(path))
    c = load_corpus(_cfg(f, tokenizer=str(path), val_fraction=0.1))
    assert len(c.train) == 9000 and len(c.val) == 1000  # contiguous tail is validation
    assert np.array_equal(np.concatenate([c.train, c.val]), ids)
    assert "max_bytes" not in capsys.readouterr().err
    c2 = load_corpus(_cfg(f, tokenizer=str(path), max_bytes=4000, val_fraction=0.1))
    assert len(c2.train) + len(c2.val) == 2000
    assert capsys.readouterr().err == (f"note: data.max_bytes keeps 2,000 of the 10,000 tokens "
                                       f"of data.source {str(f)!r}; set data.max_bytes=null to "
                                       "train on all of them\n")
    with pytest.raises(UserError, match="outside the tokenizer"):
        load_corpus(_cfg(f, tokenizer="byte"))  # ids up to 999 do not fit 256 bytes


def test_stdlib_source():
    c = load_corpus(_cfg("stdlib", max_bytes=200_000))
    n_text = len(c.train) + len(c.val) - (c.n_train_docs + c.n_val_docs - 2)  # minus EOS
    assert 190_000 <= n_text <= 210_000  # the cap (undecodable bytes may grow on re-encode)
    keys = [k for k, _ in read_documents("stdlib", 200_000)]
    assert keys == sorted(keys) and all(k.endswith(".py") for k in keys)
    assert not any(p in ("test", "tests", "site-packages") for k in keys for p in k.split("/"))


def test_split_deterministic_and_disjoint(folder):
    docs = read_documents(str(folder), None)
    tr, va = split_documents(docs, 0.25)
    tr2, va2 = split_documents(docs, 0.25)
    assert tr == tr2 and va == va2 and va
    k_tr, k_va = {k for k, _ in tr}, {k for k, _ in va}
    assert not k_tr & k_va and k_tr | k_va == {k for k, _ in docs}
    # a document's side is a hash of its own key alone, so adding/removing others moves nothing
    assert all(in_val(k, 0.25) for k in k_va) and not any(in_val(k, 0.25) for k in k_tr)
    _, va3 = split_documents(docs[:20], 0.25)
    assert {k for k, _ in va3} == k_va & {k for k, _ in docs[:20]}
    # with too few documents for the hash to pick one, one still goes to validation
    tr4, va4 = split_documents(docs[:2], 1e-9)
    assert len(tr4) == len(va4) == 1


# --------------------------------------------------------------------------- pipeline

TOKS = np.arange(20_000, dtype=np.int32) % 5000  # 20000 tokens → 1249 windows of 17


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in ("inputs", "targets"))


def test_pipeline_batches_and_determinism():
    a = _take(make_train_iterator(TOKS, 16, 8, seed=1), 5)
    b = _take(make_train_iterator(TOKS, 16, 8, seed=1), 5)
    c = _take(make_train_iterator(TOKS, 16, 8, seed=2), 5)
    x = a[0]
    assert set(x) == {"inputs", "targets"} and x["inputs"].shape == (8, 16)
    assert x["inputs"].dtype == np.int32 and x["targets"].dtype == np.int32
    assert np.array_equal(x["inputs"][:, 1:], x["targets"][:, :-1])  # shifted by one
    assert _same(a, b) and not _same(a, c)


def test_pipeline_epochs_reshuffle():
    toks = np.arange(16 * 10 + 1, dtype=np.int32)  # exactly 10 windows
    it = make_train_iterator(toks, 16, 5, seed=0)
    firsts = [tuple(b["inputs"][:, 0]) for b in _take(it, 8)]  # 4 epochs of 2 batches
    epochs = [sorted(firsts[i] + firsts[i + 1]) for i in range(0, 8, 2)]
    assert all(e == list(range(0, 160, 16)) for e in epochs)  # each epoch sees every window once
    assert len({firsts[i] + firsts[i + 1] for i in range(0, 8, 2)}) > 1  # orders differ


def test_pipeline_resume_through_json():
    straight = _take(make_train_iterator(TOKS, 16, 4, seed=3), 12)
    it = make_train_iterator(TOKS, 16, 4, seed=3)
    head = _take(it, 7)
    state = json.loads(json.dumps(it.get_state()))
    it2 = make_train_iterator(TOKS, 16, 4, seed=3)
    it2.set_state(state)
    assert _same(head + _take(it2, 5), straight)


def test_pipeline_resumes_at_its_window_under_another_global_batch():
    """The saved position counts windows: 3 batches of 4, then batches of 8 (an accepted
    train.global_batch change) or of 4 over 2 processes, continue the stream at window 12;
    an older step's {"next_index": k} counts batches of this run's size; a streaming source's
    position is a one-line error."""
    whole = np.concatenate([b["inputs"] for b in
                            _take(make_train_iterator(TOKS, 16, 12, seed=3), 3)])
    it = make_train_iterator(TOKS, 16, 4, seed=3)
    head = np.concatenate([b["inputs"] for b in _take(it, 3)])
    state = json.loads(json.dumps(it.get_state()))
    assert state == {"windows": 12}
    bigger = make_train_iterator(TOKS, 16, 8, seed=3)
    bigger.set_state(state)
    np.testing.assert_array_equal(np.concatenate([head, _take(bigger, 3)[0]["inputs"]]),
                                  whole[:20])
    procs = [make_train_iterator(TOKS, 16, 2, 3, p, 2) for p in range(2)]
    for p in procs:
        p.set_state(state)
    rows = [_take(p, 1)[0]["inputs"] for p in procs]
    np.testing.assert_array_equal(np.stack(rows, 1).reshape(4, 16), whole[12:16])
    assert procs[0].get_state() == {"windows": 16}
    older = make_train_iterator(TOKS, 16, 4, seed=3)
    older.set_state({"next_index": 3})
    np.testing.assert_array_equal(_take(older, 1)[0]["inputs"], whole[12:16])
    # train.py reads an older step's position with the global_batch its config saved
    from boost_jax.checkpoints.run_config import data_position

    saved = {"config": {"train": {"global_batch": 4}}}
    assert data_position({"next_index": 3}, saved) == {"windows": 12}
    assert data_position({"windows": 12}, saved) == {"windows": 12}
    assert data_position({"piece": 1, "offset": 5}, saved) == {"piece": 1, "offset": 5}
    with pytest.raises(UserError, match=r"^the checkpoint's data position \{'piece': 2, "
                                        r"'offset': 0\} is not a packed corpus's"):
        older.set_state({"piece": 2, "offset": 0})


def test_pipeline_sharding_disjoint_union():
    toks = np.arange(16 * 48 + 1, dtype=np.int32)  # 48 windows; 2 procs x 4 x 6 steps = epoch
    single = np.concatenate([b["inputs"][:, 0] for b in
                             _take(make_train_iterator(toks, 16, 8, seed=5), 6)])
    assert sorted(single) == list(range(0, 768, 16))
    shards = [np.concatenate([b["inputs"][:, 0] for b in
                              _take(make_train_iterator(toks, 16, 4, 5, p, 2), 6)])
              for p in range(2)]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(np.concatenate(shards)) == sorted(single)
    # step k of the two processes covers exactly step k of the single process
    s0 = _take(make_train_iterator(toks, 16, 4, 5, 0, 2), 1)[0]["inputs"][:, 0]
    s1 = _take(make_train_iterator(toks, 16, 4, 5, 1, 2), 1)[0]["inputs"][:, 0]
    assert sorted(np.concatenate([s0, s1])) == sorted(single[:8])


def test_eval_batches_fixed():
    a = make_eval_batches(TOKS, 16, 4, 3)
    b = make_eval_batches(TOKS, 16, 4, 3)
    assert len(a) == 3 and a[0]["inputs"].shape == (4, 16) and _same(a, b)
    tiny = make_eval_batches(np.arange(40, dtype=np.int32), 16, 4, 2)  # 2 windows, reused
    assert tiny[1]["inputs"].shape == (4, 16)


def test_build_data_end_to_end(folder):
    cfg = Config()
    cfg.data = _cfg(folder, seq_len=32)
    cfg.train.global_batch, cfg.train.eval_batches = 4, 2
    full = build_data(cfg)
    x = next(full.train_iter)
    assert x["inputs"].shape == (4, 32) and full.vocab_size == 256
    assert full.n_train_tokens > 0 and full.n_val_tokens > 0
    assert len(full.val_batches) == 2 and full.val_batches[0]["inputs"].shape == (4, 32)
    halves = [build_data(cfg, p, 2) for p in range(2)]
    assert next(halves[0].train_iter)["inputs"].shape == (2, 32)
    rows = np.concatenate([h.val_batches[0]["inputs"] for h in halves])
    assert sorted(map(tuple, rows)) == sorted(map(tuple, full.val_batches[0]["inputs"]))


# --------------------------------------------------------------------------- errors


def test_a_folder_with_a_broken_link_or_a_name_not_in_utf8_is_one_line(tmp_path):
    """Both ended in a traceback, through train.py and prepare alike."""
    from boost_jax.data.prepare import prepare

    (tmp_path / "dang").mkdir()
    (tmp_path / "dang" / "a.txt").write_text("some text " * 50)
    os.symlink(tmp_path / "nowhere", tmp_path / "dang" / "b.txt")
    for run in (lambda: load_corpus(_cfg(tmp_path / "dang")),
                lambda: prepare(str(tmp_path / "dang"), str(tmp_path / "o.bin"), "byte", 1,
                                progress=False)):
        with pytest.raises(UserError, match=r"^folder '.*dang' holds 'b\.txt', a link to "
                                            r"'.*nowhere', which does not exist; fix the link"):
            run()
    assert not (tmp_path / "o.bin").exists()
    from boost_jax.data.sources import reading

    with pytest.raises(UserError, match=r"^reading '.*' failed \(Is a directory\)"):
        with reading(str(tmp_path)) as f:  # what a read error (EIO) meets
            f.read()
    # a text file so named is read (its name's bytes pick its split); a shard pyarrow cannot open
    odd = os.path.join(os.fsencode(tmp_path), b"odd")
    os.mkdir(odd)
    for name in (b"a.txt", b"b\xff.txt"):
        with open(os.path.join(odd, name), "w") as f:
            f.write("some text " * 50)
    assert len(load_corpus(_cfg(tmp_path / "odd")).train) > 0
    os.mkdir(os.path.join(os.fsencode(tmp_path), b"pq"))
    with open(os.path.join(os.fsencode(tmp_path), b"pq", b"c\xff.parquet"), "w") as f:
        f.write("x")
    with pytest.raises(UserError, match=r"holds 'c\\udcff\.parquet', a name that is not UTF-8, "
                                        r"which pyarrow cannot open"):
        load_corpus(_cfg(tmp_path / "pq"))


def test_errors(tmp_path, folder):
    with pytest.raises(UserError, match="does not exist"):
        load_corpus(_cfg(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"12")
    with pytest.raises(UserError, match="contains no .txt/.py/.md/.jsonl files"):
        load_corpus(_cfg(tmp_path / "empty"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="is not a valid tokenizer.json"):
        get_tokenizer(DataConfig(tokenizer=str(bad)), list, None)
    with pytest.raises(UserError, match="does not exist"):
        get_tokenizer(DataConfig(tokenizer="bytes"), list, None)
    with pytest.raises(UserError, match="is a folder, not a file"):
        get_tokenizer(DataConfig(tokenizer=str(tmp_path)), list, None)
    j = tmp_path / "b.jsonl"
    j.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(UserError, match='line 2 has no string "text"'):
        load_corpus(_cfg(j))
    cfg = Config()
    cfg.data = _cfg(folder, seq_len=64)
    cfg.train.global_batch = 4096
    with pytest.raises(UserError, match="fewer than one global batch"):
        build_data(cfg)
    cfg.train.global_batch, cfg.model.vocab_size = 4, 128
    with pytest.raises(UserError, match="model.vocab_size=128"):
        build_data(cfg)


def test_damaged_metadata_is_one_line_not_a_key_error(tmp_path):
    """Metadata that says it is ours but lacks a field readers rely on (or holds a dtype no
    config can name) is refused with what is wrong, for data.source and data.sources."""
    f = tmp_path / "toks.bin"
    (np.arange(1000) % 200).astype(np.uint16).tofile(f)
    good = {"format": "boost_jax.tokens/1", "dtype": "uint16", "n_tokens": 1000, "max_id": 199,
            "tokenizer": "byte", "tokenizer_fingerprint": "byte"}
    for bad, what in (({}, "'dtype' is missing"), ({"n_tokens": "1000"}, "'n_tokens' is '1000'"),
                      ({"dtype": "float64"}, "dtype 'float64' is none of"),
                      ({"max_id": True}, "'max_id' is True")):
        meta = {"format": good["format"]} if not bad else dict(good, **bad)
        (tmp_path / "toks.json").write_text(json.dumps(meta))
        with pytest.raises(UserError, match=f"has damaged metadata .*toks.json \\(its {what}"):
            load_corpus(_cfg(f, tokenizer="byte"))
        from boost_jax.config import load_config

        cfg = load_config(None, [f"data.sources=[{{path: {f}, weight: 1}}]",
                                 "data.tokenizer=byte", "data.max_bytes=null"], validate=False)
        with pytest.raises(UserError, match="data.sources.0. .* has damaged metadata"):
            build_data(cfg)
    (tmp_path / "toks.json").write_text(json.dumps(good))
    assert len(load_corpus(_cfg(f, tokenizer="byte", val_fraction=0.1)).train) == 900


def test_a_resume_may_change_how_many_workers_tokenize_the_stream():
    """data.workers changes who tokenizes, not the stream: resuming with another count is not
    refused, where another data setting is."""
    from boost_jax.checkpoints.run_config import check_resume
    from boost_jax.config import load_config

    saved = load_config(None, ["data.workers=1"]).to_dict()
    assert check_resume(saved, load_config(None, ["data.workers=2"]), 8, "runs/x") == [
        ("data.workers", 1, 2)]
    with pytest.raises(UserError, match="data.seq_len"):
        check_resume(saved, load_config(None, ["data.seq_len=64"]), 8, "runs/x")


def test_a_linked_folder_is_read_once(tmp_path):
    """A symlinked folder from elsewhere is part of the source (it was skipped without a
    word); a link back up the tree is not followed round again, and a link to a folder inside
    leaves it read under its own name (keys decide the train/validation split)."""
    from boost_jax.data.sources import _walk

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("b")
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("a")
    (root / "sub").symlink_to(tmp_path / "elsewhere")
    (root / "loop").symlink_to(root)
    (root / "real").mkdir()
    (root / "real" / "c.txt").write_text("c")
    (root / "alias").symlink_to(root / "real")
    assert _walk(str(root), (".txt",), set()) == ["a.txt", "real/c.txt", "sub/b.txt"]


def test_a_run_whose_bpe_was_replaced_by_a_larger_one_is_refused(tmp_path):
    """generate / export / evaluate open a run's own BPE (out_dir/tokenizer/tokenizer.json):
    one with more ids than the run trained with (data.bpe_vocab_size, model.vocab_size) is
    another tokenizer, refused in one line instead of decoding with it. The BPE and its record
    are written with the umask's mode, as every file a run writes."""
    from types import SimpleNamespace

    from boost_jax.errors import UserError
    from boost_jax.infer.load import run_tokenizer

    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    (tmp_path / "tokenizer").mkdir()
    tok = train_bpe([text], 600, str(tmp_path / "tokenizer" / "tokenizer.json"))

    def cfg(bpe, model):
        return SimpleNamespace(data=SimpleNamespace(tokenizer="bpe", bpe_vocab_size=bpe),
                               model=SimpleNamespace(vocab_size=model))

    assert run_tokenizer(cfg(600, 600), str(tmp_path)).vocab_size == tok.vocab_size
    from boost_jax.data.bpe_cache import RECORD_FILE, write_record
    from boost_jax.safe_write import file_mode

    write_record(str(tmp_path / "tokenizer"), str(tmp_path / "tokenizer" / "tokenizer.json"),
                 {"bpe_vocab_size": 600})
    for name in ("tokenizer.json", RECORD_FILE):  # written as any new file: by the umask
        assert os.stat(tmp_path / "tokenizer" / name).st_mode & 0o777 == file_mode(), name
    for bpe, model in ((300, 300), (600, 300)):
        with pytest.raises(UserError, match=rf"has {tok.vocab_size} ids but run .* was trained "
                                            r"with at most 300: it is not the one"):
            run_tokenizer(cfg(bpe, model), str(tmp_path))
