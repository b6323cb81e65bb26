"""Corpora and tokenizers: text to token files (`shardlab data prepare`), token files read back.

Below train/ (the trainer reads token files and samples through their tokenizers) and above nothing
of shardlab's own: numpy, Hugging Face `tokenizers`, and optionally tiktoken and pyarrow.
"""

from shardlab.data.tokenfile import TokenFile, TokenFileHeader, is_token_file, read_header, read_token_file, token_dtype
from shardlab.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, token_file_tokenizer, train_bpe

__all__ = ["ByteTokenizer", "TokenFile", "TokenFileHeader", "Tokenizer", "is_token_file", "load_tokenizer",
           "read_header", "read_token_file", "token_dtype", "token_file_tokenizer", "train_bpe"]
