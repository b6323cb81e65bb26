"""The tokenizer and generation settings of a Hugging Face export, so that the model leaves whole.

    write_tokenizer(tok, "hf-model", model_max_length=1024)   # tokenizer.json, tokenizer_config.json, special_tokens_map.json
    write_generation_config("hf-model", bos=0, eos=0, suppress=range(1000, 1024))

What `transformers.AutoTokenizer.from_pretrained(OUT)` needs: `tokenizer.json` (the `tokenizers`
library's file; it alone encodes and decodes) and `tokenizer_config.json` naming the class
(`PreTrainedTokenizerFast`: the generic one, which takes everything from tokenizer.json) and the
special tokens by their text. Without them the directory "loads" an empty tokenizer.

  a tokenizer.json tokenizer (a BPE from `--train-bpe`, GPT-2's, Llama 3's): the file is copied.
  bytes: written here as a byte-level BPE with no merges, so id b is byte b (256 ids; the
         printable stand-ins for the bytes are GPT-2's byte-to-unicode table, which `tokenizers`'
         ByteLevel pre-tokenizer and decoder use). No end-of-text token.
  tiktoken: not converted (a rank file has no tokenizer.json form without rebuilding its merges);
         the export says so.

`generation_config.json`: bos/eos ids, and `suppress_tokens`, the ids past the tokenizer's
vocabulary (the rows the model's vocabulary was padded with, never trained as targets), which
`shardlab generate` never draws either: greedy decoding then agrees with `transformers`' generate.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardlab.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def byte_to_unicode() -> dict[int, str]:
    """Each byte as one printable character: printable Latin-1 bytes as themselves, the other 68 as
    the code points 256, 257, ... in byte order (the table byte-level BPEs are written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> str:
    """shardlab's byte tokenizer (id = byte value) as a `tokenizers` file."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = _Tok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def write_tokenizer(tok: Tokenizer, out: str | Path, model_max_length: int, bos: int | None = None,
                    eos: int | None = None, source: str | Path | None = None) -> list[str]:
    """Write `tok` into `out` for AutoTokenizer; returns what was written or left out, one line each.
    source: a Hugging Face directory the run started from: when its tokenizer.json is this one, its
    tokenizer_config.json and special_tokens_map.json are copied as they are."""
    from tokenizers import Tokenizer as _Tok

    out = Path(out)
    if isinstance(tok, HFTokenizer):
        shutil.copyfile(tok.path, out / "tokenizer.json")
        what = f"tokenizer.json copied from {tok.path}"
    elif isinstance(tok, ByteTokenizer):
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        what = "tokenizer.json: the byte tokenizer (id = byte value) as a byte-level BPE without merges"
    else:
        return [f"tokenizer: {type(tok).__name__} ({tok.spec().get('name')}) has no tokenizer.json form: not "
                f"written; load the model with the tokenizer it was made with"]
    src = Path(source) if source else None
    if src is not None and (src / "tokenizer.json").is_file() and \
            (src / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes():
        copied = [n for n in ("tokenizer_config.json", "special_tokens_map.json") if (src / n).is_file()]
        for n in copied:
            shutil.copyfile(src / n, out / n)
        if copied:
            return [what, f"{' and '.join(copied)} copied from {src} (the run's tokenizer is its own)"]
    fast = _Tok.from_file(str(out / "tokenizer.json"))
    special = {k: fast.id_to_token(i) for k, i in (("bos_token", bos), ("eos_token", eos)) if i is not None}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False, **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    named = ", ".join(f"{k} {v!r}" for k, v in special.items()) or "no special tokens"
    return [what, f"tokenizer_config.json: PreTrainedTokenizerFast, {named}, model_max_length {model_max_length}"]


def write_generation_config(out: str | Path, bos: int | None, eos: int | None, suppress: Iterable[int] = ()
                            ) -> dict[str, Any]:
    """out/generation_config.json: the ids generate starts and stops with, and the ids it must never pick."""
    config: dict[str, Any] = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
    suppress = list(suppress)
    if suppress:
        config["suppress_tokens"] = suppress
    (Path(out) / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config
