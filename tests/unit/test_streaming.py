"""A streaming source (data/streaming.py): the same tokens as `prepare`, windows in grain's piece
order, an exact resume from {piece, offset}, the process split, grain worker processes, and
one-line errors for bad shards."""

import os
import re

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import grain  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from boost_jax.config import load_config  # noqa: E402
from boost_jax.data import streaming  # noqa: E402
from boost_jax.data.pipeline import build_data  # noqa: E402
from boost_jax.data.tokenizers import ByteTokenizer  # noqa: E402
from boost_jax.errors import ConfigError, UserError  # noqa: E402


def shards(d, n_docs=240, groups=(50, 70)):
    """Two parquet shards of real text (row groups of 50 and 70 rows) and the documents."""
    import argparse

    text = open(argparse.__file__, encoding="utf-8").read()
    docs = [text[i * 211:(i + 1) * 211] for i in range(n_docs)]
    os.makedirs(os.path.join(d, "sub"), exist_ok=True)
    half = n_docs // 2
    pq.write_table(pa.table({"text": docs[:half]}), os.path.join(d, "a.parquet"),
                   row_group_size=groups[0])
    pq.write_table(pa.table({"text": docs[half:], "n": list(range(n_docs - half))}),
                   os.path.join(d, "sub", "b.parquet"), row_group_size=groups[1])
    return docs


def cfg(path, *extra):
    return load_config(None, [f"data.sources=[{{path: {path}, weight: 1}}]", "data.seq_len=32",
                              "train.global_batch=8", "train.eval_batches=2", *extra])


def _ids(docs):
    return np.frombuffer("".join(d + "\0" for d in docs).encode(), np.uint8).astype(np.int32)


def test_stream_is_prepares_tokens_in_grains_piece_order(tmp_path):
    from boost_jax.data.prepare import prepare

    docs = shards(tmp_path / "s")
    prepare(str(tmp_path / "s"), str(tmp_path / "p.bin"), "byte", workers=1, progress=False)
    assert (np.fromfile(tmp_path / "p.bin", np.uint16) == _ids(docs)).all()  # same documents
    c = cfg(tmp_path / "s")
    s = streaming.Stream(str(tmp_path / "s"), c.data, ByteTokenizer())
    n_val = round(len(docs) * c.data.val_fraction)
    assert s.n_train_docs == len(docs) - n_val
    assert (s.val == _ids(docs[-n_val:])).all()  # the tail, read whatever the train position
    # pieces (file, row, rows) stay within a row group; the val tail is cut off file b
    assert s.pieces == [(0, 0, 50), (0, 50, 50), (0, 100, 20), (1, 0, 70), (1, 70, 38)]
    order = grain.MapDataset.source(list(range(len(s.pieces)))).shuffle(seed=0)
    pieces = [s.pieces[order[i]] for i in range(len(s.pieces))]
    expect = np.concatenate([streaming.encode(ByteTokenizer(), s.shards.texts(*p))
                             for p in pieces])
    it = build_data(c).train_iter
    got = np.concatenate([next(it)["inputs"].reshape(-1) for _ in range(len(expect) // 256)])
    assert (got == expect[: len(got)]).all()


def test_save_to_disk_folder_streams(tmp_path):
    """The layout datasets' save_to_disk writes: arrow IPC stream files next to its JSON."""
    docs = [f"document {i} " * 7 for i in range(100)]
    d = tmp_path / "saved"
    d.mkdir()
    (d / "dataset_info.json").write_text("{}")
    for k, part in enumerate((docs[:60], docs[60:])):
        with pa.ipc.new_stream(str(d / f"data-0000{k}-of-00002.arrow"),
                               pa.schema([("text", pa.string())])) as w:
            w.write_table(pa.table({"text": part}), max_chunksize=16)
    s = streaming.Stream(str(d), cfg(d).data, ByteTokenizer())
    assert s.pieces == [(0, 0, 60), (1, 0, 35)] and (s.val == _ids(docs[95:])).all()
    assert s.shards.texts(1, 3, 2) == docs[63:65]


def test_resume_from_state_and_process_split(tmp_path):
    shards(tmp_path / "s")
    c = cfg(tmp_path / "s")
    it = build_data(c).train_iter
    for _ in range(200):  # past an epoch (about 190 batches): the pieces reshuffle
        next(it)
    state = it.get_state()
    assert set(state) == {"piece", "offset"} and state["piece"] >= 5 and state["offset"] > 0
    after = [next(it) for _ in range(4)]
    again = build_data(c).train_iter
    again.set_state(state)
    for a in after:
        assert (next(again)["inputs"] == a["inputs"]).all()
    # process 1 of 2 takes rows 1, 3, 5, 7 of the same global batches
    half = build_data(c, 1, 2).train_iter
    half.set_state(state)
    assert (next(half)["targets"] == after[0]["targets"][1::2]).all()
    with pytest.raises(UserError, match=r"is not a streaming source's"):
        again.set_state({"next_index": 3})


def test_grain_worker_processes_give_the_same_stream(tmp_path):
    shards(tmp_path / "s")
    threads = build_data(cfg(tmp_path / "s")).train_iter
    workers = build_data(cfg(tmp_path / "s", "data.workers=2")).train_iter
    try:
        for _ in range(8):
            assert (next(threads)["inputs"] == next(workers)["inputs"]).all()
    finally:
        workers.close()


def test_bad_shards_are_one_line(tmp_path):
    bad = pa.array([b"good text " * 20, b"\xff\xfe not UTF-8"] * 20,
                   type=pa.binary()).view(pa.string())
    (tmp_path / "utf8").mkdir()
    pq.write_table(pa.table({"text": bad}), tmp_path / "utf8" / "a.parquet")
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "a.parquet").write_text("a text file, not parquet\n")
    (tmp_path / "col").mkdir()
    pq.write_table(pa.table({"body": ["x"] * 4}), tmp_path / "col" / "a.parquet")
    (tmp_path / "bin").mkdir()  # read as empty documents: a stream of end-of-text ids
    pq.write_table(pa.table({"text": pa.array([b"good text"] * 4, pa.binary())}),
                   tmp_path / "bin" / "a.parquet")
    cases = {"utf8": r"has bytes that are not UTF-8 in column 'text' \(at or after row \d+\)",
             "fake": r"is not a readable parquet file \(.*\); pass a real \.parquet file",
             "col": r"has no column 'text' \(columns: \['body'\]\)",
             "bin": r"column 'text' holds binary, not text; write it as a string column"}
    for name, why in cases.items():
        with pytest.raises(UserError) as e:
            build_data(cfg(tmp_path / name))
        msg = str(e.value)
        assert "\n" not in msg and re.match(rf"data.sources\[0\] file '.*/{name}/a.parquet' "
                                            + why, msg), msg


def test_config_refuses_a_streamed_mixture_and_bpe(tmp_path):
    shards(tmp_path / "s")
    with pytest.raises(UserError, match=r"holds parquet/arrow shards, which data.source does "
                                        r"not read; stream them with data.sources=\[\{path: "):
        build_data(load_config(None, [f"data.source={tmp_path / 's'}"]))
    (tmp_path / "s" / "README.md").write_text("---\nlicense: mit\n---\n")  # a dataset card
    with pytest.raises(UserError, match=r"holds parquet/arrow shards, which data.source does "):
        build_data(load_config(None, [f"data.source={tmp_path / 's'}"]))
    two = f"data.sources=[{{path: {tmp_path / 's'}}}, {{path: {tmp_path / 's'}}}]"
    with pytest.raises(ConfigError, match=r"possible for a single source only"):
        load_config(None, [two])
    with pytest.raises(ConfigError, match=r"streamed, so data.tokenizer=bpe"):
        cfg(tmp_path / "s", "data.tokenizer=bpe")
    with pytest.raises(ConfigError, match=r"data.workers=-1 must be >= 0"):
        cfg(tmp_path / "s", "data.workers=-1")


def test_grain_worker_join_is_cut_short_in_the_pinned_grain():
    """_short_worker_join sets a private grain constant: a grain upgrade that renames it would
    bring back the 25 s wait at every exit silently, so it fails here instead."""
    from grain._src.python.dataset.transformations import process_prefetch

    from boost_jax.data.streaming import _short_worker_join

    assert hasattr(process_prefetch, "_PROCESS_KILL_TIMEOUT_S")
    _short_worker_join(2.0)
    assert process_prefetch._PROCESS_KILL_TIMEOUT_S <= 2.0
