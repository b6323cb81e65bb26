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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab.checkpoint import CheckpointError, load_checkpoint, read_metadata
from shardlab.checkpoint.format import resolve_checkpoint
from shardlab.checkpoint.hf import hf_model_fields, read_hf
from shardlab.data.tokenizer import Tokenizer, load_tokenizer
from shardlab.models import GPT
from shardlab.parallel.layout import build_mesh
from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.sharding.section import ShardingSection
from shardlab.train.config import Config
from shardlab.train.corpus import DataSource
from shardlab.train.corpus_checks import tokenizer_identity
from shardlab.train.loop import rank_device
from shardlab.train.resolve import resolve_run
from shardlab.train.sample import sample_ids
from shardlab.train.sections import CheckpointSection, DataSection, LogSection, ModelSection
from shardlab.train.task import build_model, gpt_config


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


def _checkpoint(p: Path):
    """(the checkpoint directory, its metadata, the run's Config) for a run, root or step_N directory."""
    try:
        ckpt = resolve_checkpoint(p)  # a run directory's checkpoints/ too
        meta = read_metadata(ckpt)
    except CheckpointError as exc:
        raise GenerateError(f"{exc} (nor a Hugging Face directory: config.json and *.safetensors)") from exc
    saved = meta.config or {}
    if (saved.get("model") or {}).get("name", "gpt") != "gpt" or "model/tok_emb.weight" not in meta.tensors:
        raise GenerateError(f"{ckpt}: the checkpoint is not of a GPT (model.name "
                            f"{(saved.get('model') or {}).get('name')!r}); only a language model generates text")
    cfg = Config.from_dict(saved, origin=f"{ckpt}/metadata.json")
    cfg.model.vocab_size = meta.tensors["model/tok_emb.weight"].shape[0]  # the saved table is the truth
    return ckpt, meta, cfg


def tokenizer_note(d: DataSection, tok: Tokenizer) -> str | None:
    """A note when --tokenizer (`tok`) is not the tokenizer the run's data (its saved data.* fields)
    records: one of the same size loads without an error, but its ids mean other text (None: the same,
    or the run's cannot be told)."""
    recorded, given = tokenizer_identity(asdict(d)), tok.spec().get("sha256", "bytes")
    if recorded is None or recorded == given:
        return None
    return (f"--tokenizer {tok.spec()['name']} (sha256 {given}) is not the tokenizer the run trained with "
            f"(data.source = {d.source!r}: {recorded}); its ids mean other text to this model")


def _run_tokenizer(ckpt: Path, d: DataSection, tokenizer: str | None, notes: list[str]) -> Tokenizer:
    """--tokenizer (a note added to `notes` when it is not the run's), else the tokenizer of the run's
    data (its saved data.* fields)."""
    if tokenizer:
        tok = _tokenizer(tokenizer, "--tokenizer")
        note = tokenizer_note(d, tok)
        notes.extend([note] if note else [])
        return tok
    try:
        tok = DataSource(d).tokenizer
    except (OSError, ValueError, ImportError) as exc:
        raise GenerateError(f"{ckpt}: the run's tokenizer (data.source = {d.source!r}, data.tokenizer = "
                            f"{d.tokenizer!r}) cannot be loaded: {exc}; give --tokenizer FILE") from exc
    if tok is None:
        raise GenerateError(f"{ckpt}: the run trained on raw ids ({d.source}) that name no tokenizer: "
                            f"give --tokenizer FILE (the one the ids were made with)")
    return tok


def _load_checkpoint(p: Path, tokenizer: str | None) -> Loaded:
    ckpt, meta, cfg = _checkpoint(p)
    model = build_model(cfg.model)
    if not isinstance(model, GPT):
        raise GenerateError(f"{ckpt}: model.name {cfg.model.name!r} is not a language model")
    info, notes = load_checkpoint(ckpt, model, None, restore_rng=False), []
    tok = _run_tokenizer(ckpt, cfg.data, tokenizer, notes)
    return Loaded(model, tok, f"checkpoint {ckpt} (step {meta.step})", notes + info.notes)


# ------------------------------------------------------------------------------ under a layout
def layout_plan(path: str | os.PathLike, tokenizer: str | None, tp: int = 1, pp: int = 1,
                world: int | None = None) -> tuple[str, Config, Tokenizer, str]:
    """For generating under tensor and/or pipeline parallelism: the checkpoint, the configuration the
    ranks build (the run's model; only the layout's degrees set, everything else of the layout,
    data, logging and checkpointing at its defaults, so that nothing of the training run is needed),
    the tokenizer, and a description. ConfigError names what the model cannot be split by, or a
    world (torchrun's) that is not tp x pp ranks."""
    p = Path(path).expanduser()
    if is_hf_directory(p):
        raise GenerateError(f"{p}: a Hugging Face directory generates in one process; --tp and --pp read a "
                            f"shardlab checkpoint")
    if not p.exists():
        raise GenerateError(f"{p}: no such file or directory")
    ckpt, meta, run = _checkpoint(p)
    notes: list[str] = []
    tok = _run_tokenizer(ckpt, run.data, tokenizer, notes)
    cfg = Config.from_dict(run.to_dict())
    cfg.layout, cfg.sharding = LayoutSection(tp=tp, pp=pp), ShardingSection()
    cfg.data, cfg.log, cfg.checkpoint = DataSection(), LogSection(out_dir=str(ckpt)), CheckpointSection()
    cfg.train.micro_batches, cfg.train.global_batch, cfg.model.dropout = 1, 1, 0.0
    cfg.validate(tp * pp if world is None else world)
    return str(ckpt), cfg, tok, "\n# ".join([f"checkpoint {ckpt} (step {meta.step}), tp {tp} x pp {pp}", *notes])


def generate_rank(ckpt: str, cfg_dict: dict, ids: list[int], n_tokens: int, vocab: int, temperature: float,
                  top_k: int, top_p: float, seed: int) -> list[int] | None:
    """Every rank: the run's model under cfg_dict's layout, the checkpoint resharded into it, the
    prompt continued (every rank alike: each forward needs them all); rank 0 returns the ids."""
    cfg = Config.from_dict(cfg_dict)
    device = rank_device()
    # The model only (its vocabulary the checkpoint's): the data is not read. Laid out as the trainer lays it out.
    model = resolve_run(cfg).apply(build_model(cfg.model).to(device), build_mesh(cfg.layout))
    load_checkpoint(ckpt, model, None, restore_rng=False)
    out = sample_ids(model, cfg.model.seq_len, ids, n_tokens, vocab, temperature, top_k, top_p, seed, device)
    return out if dist.get_rank() == 0 else None


def _load_hf(p: Path, tokenizer: str | None) -> Loaded:
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
