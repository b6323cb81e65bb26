"""A trained model and its tokenizer, loaded into one process for `shardlab generate`.

    loaded = load_for_generation("runs/gpt-small")              # a run, a checkpoint root or step_N/
    loaded = load_for_generation("hf-model")                    # a Hugging Face GPT-2 / Llama directory
    text = loaded.generate("def ", 100, temperature=0.8, top_k=40, top_p=0.95, seed=0)

A shardlab checkpoint is resharded on load (checkpoint/load.py): whatever layout saved it, it is
read into the plain model the run's saved configuration describes, in fp32. The tokenizer is the
run's (train/corpus.py's corpus_tokenizer, from the saved data.* fields), or the directory's
tokenizer.json for a Hugging Face model (`checkpoint export --hf` writes one), or the one given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardlab.data.tokenizer import Tokenizer, load_tokenizer
from shardlab.models import GPT
from shardlab.train.config import Config
from shardlab.train.sample import sample_ids


class GenerateError(ValueError):
    """The model or tokenizer cannot be loaded; the message names the file and what to do."""


@dataclass
class Loaded:
    model: GPT
    tokenizer: Tokenizer
    source: str
    """What was loaded: 'checkpoint runs/x/checkpoints/step_00000200 (step 200)' or 'Hugging Face hf-model'."""
    notes: list[str] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.model.cfg.seq_len

    def generate(self, prompt: str, n_tokens: int, temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0,
                 seed: int = 0) -> str:
        """The prompt and its continuation, decoded (train/sample.py's next_token chooses each id)."""
        return self.tokenizer.decode(self.generate_ids(self.encode(prompt), n_tokens, temperature, top_k, top_p, seed))

    def encode(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        ids = tok.encode(prompt) or ([tok.eot] if tok.eot is not None else [])
        if not ids:
            raise GenerateError("the prompt is empty and the tokenizer has no end-of-text token to start from: "
                                "give --prompt")
        return ids

    def generate_ids(self, ids: list[int], n_tokens: int, temperature: float = 0.8, top_k: int = 40,
                     top_p: float = 1.0, seed: int = 0) -> list[int]:
        return sample_ids(self.model, self.seq_len, ids, n_tokens, self.tokenizer.vocab_size, temperature, top_k,
                          top_p, seed)


def is_hf_directory(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def load_for_generation(path: str | os.PathLike, tokenizer: str | None = None,
                        device: str | torch.device = "cpu") -> Loaded:
    """The model at `path` (a run directory holding checkpoints/, a checkpoint root, one step_N
    directory, or a Hugging Face directory) in eval mode on `device`, with its tokenizer
    (`tokenizer`: a tokenizer.json, a tiktoken file or 'bytes' in its place)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise GenerateError(f"{p}: no such file or directory (give a run directory, a checkpoint, or a Hugging "
                            f"Face model directory)")
    loaded = _load_hf(p, tokenizer) if is_hf_directory(p) else _load_checkpoint(p, tokenizer)
    vocab = loaded.model.cfg.vocab_size
    if loaded.tokenizer.vocab_size > vocab:
        raise GenerateError(f"the tokenizer has {loaded.tokenizer.vocab_size:,} ids but the model only {vocab:,} "
                            f"rows: not the tokenizer it was trained with")
    loaded.model.to(device).eval()
    return loaded


def _tokenizer(spec: str, what: str) -> Tokenizer:
    try:
        return load_tokenizer(spec)
    except (OSError, ValueError, ImportError) as exc:
        raise GenerateError(f"{what}: {exc}") from exc


def _load_checkpoint(p: Path, tokenizer: str | None) -> Loaded:
    from shardlab.checkpoint import CheckpointError, load_checkpoint, read_metadata
    from shardlab.checkpoint.format import resolve_checkpoint
    from shardlab.train.corpus import corpus_tokenizer
    from shardlab.train.task import build_model

    root = p / "checkpoints" if (p / "checkpoints").is_dir() and not (p / "metadata.json").is_file() else p
    try:
        ckpt = resolve_checkpoint(root)
        meta = read_metadata(ckpt)
    except CheckpointError as exc:
        raise GenerateError(f"{exc} (nor a Hugging Face directory: config.json and *.safetensors)") from exc
    saved = meta.config or {}
    if (saved.get("model") or {}).get("name", "gpt") != "gpt" or "model/tok_emb.weight" not in meta.tensors:
        raise GenerateError(f"{ckpt}: the checkpoint is not of a GPT (model.name "
                            f"{(saved.get('model') or {}).get('name')!r}); only a language model generates text")
    cfg = Config.from_dict(saved, origin=f"{ckpt}/metadata.json")
    vocab = meta.tensors["model/tok_emb.weight"].shape[0]  # the saved table is the truth
    model = build_model(cfg.model, vocab)
    if not isinstance(model, GPT):
        raise GenerateError(f"{ckpt}: model.name {cfg.model.name!r} is not a language model")
    info = load_checkpoint(ckpt, model, None, restore_rng=False)
    if tokenizer:
        tok = _tokenizer(tokenizer, "--tokenizer")
    else:
        try:
            tok = corpus_tokenizer(cfg)
        except (OSError, ValueError, ImportError) as exc:
            raise GenerateError(f"{ckpt}: the run's tokenizer (data.source = {cfg.data.source!r}, data.tokenizer = "
                                f"{cfg.data.tokenizer!r}) cannot be loaded: {exc}; give --tokenizer FILE") from exc
        if tok is None:
            raise GenerateError(f"{ckpt}: the run trained on raw ids ({cfg.data.source}) that name no tokenizer: "
                                f"give --tokenizer FILE (the one the ids were made with)")
    return Loaded(model, tok, f"checkpoint {ckpt} (step {meta.step})", info.notes)


def _load_hf(p: Path, tokenizer: str | None) -> Loaded:
    from shardlab.checkpoint import CheckpointError
    from shardlab.checkpoint.hf import hf_model_fields, read_hf
    from shardlab.train.sections import ModelSection
    from shardlab.train.task import gpt_config

    try:
        fields = hf_model_fields(p)
        section = ModelSection(**fields)
        model = GPT(gpt_config(section))
        state = read_hf(p, model.cfg)
    except CheckpointError as exc:
        raise GenerateError(str(exc)) from exc
    with torch.no_grad():
        model.load_state_dict({n: state[n] for n in model.state_dict()})
    if tokenizer:
        tok = _tokenizer(tokenizer, "--tokenizer")
    elif (p / "tokenizer.json").is_file():
        tok = _tokenizer(str(p / "tokenizer.json"), str(p))
    else:
        raise GenerateError(f"{p}: no tokenizer.json beside the model: give --tokenizer FILE ('bytes' for a "
                            f"byte-level model)")
    return Loaded(model, tok, f"Hugging Face {p}")
