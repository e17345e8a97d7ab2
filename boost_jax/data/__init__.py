"""Data: tokenizers, corpus sources, and the grain training/eval pipeline."""

from boost_jax.data.pipeline import (DataBundle, PackedSequences, build_data,
                                     make_eval_batches, make_train_iterator)
from boost_jax.data.sources import Corpus, load_corpus, read_documents, split_documents
from boost_jax.data.tokenizers import (ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer,
                                       train_bpe)

__all__ = [
    "ByteTokenizer", "Corpus", "DataBundle", "HFTokenizer", "PackedSequences", "Tokenizer",
    "build_data", "get_tokenizer", "load_corpus", "make_eval_batches", "make_train_iterator",
    "read_documents", "split_documents", "train_bpe",
]
