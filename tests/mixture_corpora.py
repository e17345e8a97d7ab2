"""Two small prepared corpora for the data.sources mixture tests, in-process and through
train.py alike."""

import pytest

from boost_jax.data.prepare import prepare


def _corpus(tmp_path, name, module, tokenizer="byte"):
    """A .bin prepared from a standard-library source file (real text, a few tens of KB)."""
    import importlib

    src = tmp_path / f"{name}.txt"
    path = importlib.import_module(module).__file__
    src.write_text(open(path, encoding="utf-8").read())
    out = str(tmp_path / f"{name}.bin")
    prepare(str(src), out, tokenizer, workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    return _corpus(d, "a", "argparse"), _corpus(d, "b", "json.decoder")


def _sources(a, b, wa=0.7, wb=0.3):
    return f"data.sources=[{{path: {a}, weight: {wa}}}, {{path: {b}, weight: {wb}}}]"
