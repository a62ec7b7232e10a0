"""Training data: read documents (``sources``), tokenize them (``tokenizer``) into memory-mapped shards
(``dataset``) and stream packed batches from them (``loader``)."""

from griffin.data.dataset import VAL_FRACTION, load_dataset_tokenizer, load_meta, prepare
from griffin.data.loader import Batch, PackedLoader, eval_batches, unigram_loss
from griffin.data.sources import default_corpus_files, iter_documents

__all__ = [
    "VAL_FRACTION",
    "Batch",
    "PackedLoader",
    "default_corpus_files",
    "eval_batches",
    "iter_documents",
    "load_dataset_tokenizer",
    "load_meta",
    "prepare",
    "unigram_loss",
]
