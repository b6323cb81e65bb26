"""`shardlab checkpoint export --hf`: a trained checkpoint as a Hugging Face directory that travels whole.

    notes = export_hf("runs/x/checkpoints", "hf-model")   # what was written, and what was changed, one line each

Beside checkpoint/hf.py's model.safetensors and config.json: the run's tokenizer
(checkpoint/hf_tokenizer.py: tokenizer.json, tokenizer_config.json, special_tokens_map.json),
generation_config.json, and bos/eos ids (the tokenizer's end-of-text token, as GPT-2 uses it for
both; a source model's own ids when the run started from one). A run that started from a Hugging
Face checkpoint (model.init_from_hf) keeps that model's settings the training did not change: its
position limit (GPT-2: the rows of the position table past model.seq_len are the source's, untrained
here, so the export reads as long a context as the source did; Llama: max_position_embeddings).
Dropout is what was trained (model.dropout, which --init-from-hf takes from the source's resid_pdrop),
never the source's: checkpoint/hf.py's hf_config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from shardlab.checkpoint import CheckpointError, full_tensors, read_metadata
from shardlab.checkpoint.format import resolve_checkpoint
from shardlab.checkpoint.hf import hf_family, read_hf_tensor, save_hf
from shardlab.checkpoint.hf_tokenizer import write_generation_config, write_tokenizer
from shardlab.models.gpt import GPTConfig
from shardlab.train.config import Config
from shardlab.train.corpus import DataSource
from shardlab.train.sections import DataSection
from shardlab.train.task import gpt_config


def export_hf(path: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Write the checkpoint at `path` (or the newest under it) to the directory `out`; returns the
    lines that say what was written and what differs from the trained model's own settings."""
    ckpt = resolve_checkpoint(path)
    meta = read_metadata(ckpt)
    saved = meta.config
    if not saved or (saved.get("model") or {}).get("name", "gpt") != "gpt":
        raise CheckpointError(f"{ckpt}: the checkpoint's configuration does not describe a GPT "
                              f"(model.name {((saved or {}).get('model') or {}).get('name')!r}); only the GPT "
                              f"exports to Hugging Face")
    cfg = Config.from_dict(saved)
    gcfg = gpt_config(cfg.model)
    tensors = full_tensors(ckpt, "model/")
    gcfg.vocab_size = tensors["tok_emb.weight"].shape[0]  # the saved table is the truth
    family = hf_family(gcfg)
    notes: list[str] = []
    tok = _tokenizer(cfg.data, notes)
    bos = eos = tok.eot if tok is not None else None
    extra: dict = {}
    if cfg.model.init_from_hf:
        bos, eos = _keep_source(Path(cfg.model.init_from_hf), family, gcfg, tensors, notes, bos, eos)
    elif family == "gpt2":
        notes.append(f"n_positions {gcfg.seq_len}: model.seq_len, the positions the model has")
    notes.append(f"dropout {gcfg.dropout}: model.dropout, what was trained" + (
        " (resid_pdrop, attn_pdrop; embd_pdrop 0.0: shardlab has none after the embeddings)" if family == "gpt2"
        else " (attention_dropout)"))
    extra.update(bos_token_id=bos, eos_token_id=eos)
    named = f" ({tok.decode([eos])!r})" if tok is not None and eos is not None and eos < tok.vocab_size else ""
    notes.append(f"bos_token_id {bos}, eos_token_id {eos}{named}" + ("" if eos is not None else
                 ": the tokenizer has no end-of-text token (generation stops at max_new_tokens)"))
    out = save_hf(gcfg, tensors, out, extra=extra)
    notes.insert(0, f"wrote {out}/model.safetensors and config.json ({family}, step {meta.step})")
    if tok is not None:
        limit = gcfg.seq_len
        notes += write_tokenizer(tok, out, limit, bos, eos, source=cfg.model.init_from_hf or None)
    suppress = range(tok.vocab_size, gcfg.vocab_size) if tok is not None else range(0)
    write_generation_config(out, bos, eos, suppress)
    notes.append("generation_config.json: bos/eos" + (
        f"; ids {suppress.start}-{suppress.stop - 1} suppressed (the {len(suppress)} rows the vocabulary was "
        f"padded with past the tokenizer's {tok.vocab_size:,} ids)" if len(suppress) else ""))
    return notes


def _tokenizer(d: DataSection, notes: list[str]):
    """The tokenizer of the run's data (its saved data.* fields), or None with a note saying why not."""
    try:
        tok = DataSource(d).tokenizer
    except (OSError, ValueError, ImportError) as exc:
        notes.append(f"tokenizer: not written: the run's (data.source = {d.source!r}, data.tokenizer = "
                     f"{d.tokenizer!r}) cannot be loaded here: {exc}")
        return None
    if tok is None:
        notes.append(f"tokenizer: not written: data.source = {d.source!r} holds raw ids naming no tokenizer "
                     f"(data.tokenizer)")
    return tok


def _keep_source(src: Path, family: str, gcfg: GPTConfig, tensors: dict[str, torch.Tensor],
                 notes: list[str], bos: int | None, eos: int | None) -> tuple[int | None, int | None]:
    """What the run kept of the Hugging Face model it started from: position limit, bos/eos."""
    if not (src / "config.json").is_file():
        notes.append(f"model.init_from_hf = {str(src)!r}: no config.json there now, so the position limit "
                     f"({gcfg.seq_len}) is the run's")
        return bos, eos
    source = json.loads((src / "config.json").read_text())
    limit = source.get("n_positions" if family == "gpt2" else "max_position_embeddings") or gcfg.seq_len
    if limit > gcfg.seq_len:
        trained = gcfg.seq_len
        if family == "llama":  # rotary: no table, only the number
            notes.append(f"max_position_embeddings {trained} -> {limit}: the source's (trained on {trained})")
            gcfg.seq_len = limit
        else:
            table = read_hf_tensor(src, "transformer.wpe.weight")
            if table is not None and table.shape[0] >= limit and table.shape[1] == gcfg.d_model:
                ours = tensors["pos_emb.weight"]
                tensors["pos_emb.weight"] = torch.cat([ours, table[trained:limit].to(ours.dtype)])
                notes.append(f"n_positions {trained} -> {limit}: position rows 0-{trained - 1} trained, rows "
                             f"{trained}-{limit - 1} the source's ({src})")
                gcfg.seq_len = limit
            else:
                notes.append(f"n_positions {trained}: the source's {limit}-row position table is not in {src} "
                             f"now; only the trained rows are exported")
    ids = [source.get(k) for k in ("bos_token_id", "eos_token_id")]
    if all(isinstance(i, int) and 0 <= i < gcfg.vocab_size for i in ids):
        return ids[0], ids[1]
    return bos, eos
