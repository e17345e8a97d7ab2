"""Data: tokenizers, corpus sources, the grain training/eval pipeline, and `prepare` (a corpus
tokenized ahead of time into a .bin memmap).

Names are imported on first use, so tools that need only the tokenizers or the .bin format
(python -m boost_jax.data.prepare and its worker processes) start without grain and JAX.
"""

import importlib

_WHERE = {
    "DataBundle": "pipeline", "PackedSequences": "pipeline", "build_data": "pipeline",
    "make_eval_batches": "pipeline", "make_train_iterator": "pipeline",
    "make_mixture_iterator": "pipeline", "load_splits": "pipeline", "eval_batches": "pipeline",
    "Corpus": "sources", "load_corpus": "sources", "read_documents": "sources",
    "split_documents": "sources",
    "ByteTokenizer": "tokenizers", "HFTokenizer": "tokenizers", "Tokenizer": "tokenizers",
    "get_tokenizer": "tokenizers", "train_bpe": "tokenizers",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
