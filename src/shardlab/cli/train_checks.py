"""What `shardlab train` checks before any rank starts, beyond the configuration's own rules
(train/config_check.py): a Hugging Face checkpoint's shape, output directories, the data and its
vocabulary. Each raises ConfigError naming the field and the value."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

from safetensors import SafetensorError

from shardlab.checkpoint.format import CheckpointError, list_checkpoints, read_metadata
from shardlab.checkpoint.hf import TRAINING_FIELDS, hf_import_notes, hf_model_fields, read_hf
from shardlab.cli.flags import FlagError, check_writable_dir
from shardlab.train.config import ConfigError, toml_value
from shardlab.train.corpus import load_corpus
from shardlab.train.corpus_checks import check_token_ids, overlap_problem, tokenizer_identity
from shardlab.train.loop import checkpoint_dir
from shardlab.train.resolve import resolve_run
from shardlab.train.task import empty_model, hf_misfit


def hf_assignments(path: str) -> list[str]:
    """`--init-from-hf DIR` as model.* assignments: the checkpoint's shape, then where to load it from."""
    try:
        fields = hf_model_fields(path)
        notes = hf_import_notes(path)
    except (CheckpointError, OSError, ValueError) as exc:
        raise ConfigError(f"--init-from-hf {path}: {exc}") from exc
    for note in notes:  # what the run cannot train as the source model did, each field named
        print(f"shardlab: --init-from-hf: {note}", file=sys.stderr)
    return [f"model.{k}={toml_value(v)}" for k, v in fields.items()] + [f"model.init_from_hf={toml_value(path)}"]


def hf_problems(m) -> list[str]:
    """Where the model.* fields differ from the Hugging Face checkpoint model.init_from_hf names."""
    try:
        fields = hf_model_fields(m.init_from_hf)
    except (CheckpointError, OSError, ValueError) as exc:
        return [f"model.init_from_hf = {m.init_from_hf!r}: {exc}"]
    out = []
    for k, v in fields.items():
        if k in TRAINING_FIELDS:  # the run's to choose (--set after --init-from-hf)
            continue
        ours = getattr(m, k)
        if k == "n_kv_head":
            ours, v = ours or m.n_head, v or fields["n_head"]
        if k == "seq_len" and fields["rotary"] is False and ours > v:
            out.append(f"model.seq_len = {ours} is longer than the checkpoint's {v} learned positions")
        elif k != "seq_len" and (abs(ours - v) > 1e-12 * abs(v) if isinstance(v, float) else ours != v):
            out.append(f"model.{k} = {ours!r}, but the checkpoint {m.init_from_hf} has {v!r}")
    return out


def hf_tensor_misfit(m) -> str | None:
    """The tensors of the Hugging Face checkpoint model.init_from_hf names that are missing or of
    another shape than the model's, read from the files' headers (no weights loaded): found here, not
    in every rank after launch. None when they fit."""
    model = empty_model(m)
    try:
        state = read_hf(m.init_from_hf, model.cfg, shapes_only=True)
    except (CheckpointError, OSError, SafetensorError) as exc:  # a missing tensor; a damaged file
        return f"model.init_from_hf = {m.init_from_hf!r}: {exc}"
    return hf_misfit(model, state, m.init_from_hf)


def check_before_launch(cfg, make_out_dir: bool = True) -> None:
    """What validation cannot see without building the model (on the meta device: no memory) or
    touching the disk; raises ConfigError."""
    if cfg.model.init_from_hf:
        problems = hf_problems(cfg.model)
        if problems:
            raise ConfigError("the model does not fit its Hugging Face checkpoint:\n  - " + "\n  - ".join(problems))
        misfit = hf_tensor_misfit(cfg.model)
        if misfit:
            raise ConfigError(misfit)
    names = [n for n, _ in empty_model(cfg.model).named_parameters()]
    for pattern in filter(None, (p.strip() for p in cfg.model.freeze.split(","))):
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(f"model.freeze pattern {pattern!r} matches no parameter of the {cfg.model.name} "
                              f"(names look like {names[0]!r}, {names[-1]!r})")
    if names and all(cfg.frozen(n) for n in names):
        raise ConfigError(f"model.freeze = {cfg.model.freeze!r} freezes all {len(names)} parameters of the "
                          f"{cfg.model.name}: nothing would train")
    if make_out_dir:
        make_run_dirs(cfg)


def make_run_dirs(cfg) -> None:
    """log.out_dir created, it and checkpoint.dir checked writable: the last check before launch, so
    that a launch refused by any other (the data's, say) leaves no empty run directory behind."""
    try:
        Path(cfg.log.out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"log.out_dir = {cfg.log.out_dir!r} cannot be created: {exc.strerror}") from exc
    # Found now, not at the first save or the last step's summary.
    for field, where in (("log.out_dir", cfg.log.out_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if where:
            try:
                check_writable_dir(field, where)
            except FlagError as exc:
                raise ConfigError(str(exc).replace(f"{field} {where}:", f"{field} = {where!r}:", 1)) from None


def resolve_before_launch(cfg):
    """train/resolve.py's Run of `cfg`, resolved once for the ranks (cfg stays as written); a data source
    that cannot say its vocabulary raises ConfigError naming it."""
    try:
        return resolve_run(cfg)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(str(exc)) from exc


def check_data_before_launch(run):
    """`run` (train/resolve.py's Run) with its data prepared before any rank starts (text for a tokenizer
    other than bytes encoded, once, cached: Run.prepared), every id checked against model.vocab_size
    (naming the id and the file), and a sample needing a tokenizer to be read. Raises ConfigError."""
    if run.data is None:
        return run
    try:
        run = run.prepared()
        cfg = run.config
        src, seq = run.data, cfg.model.seq_len
        # As the ranks will read it (a token file is memory-mapped, not read): a corpus too small for
        # the model's windows is refused here, not by every rank after the launch.
        train_ids = load_corpus(src, seq, split=not cfg.data.val_source)
        check_token_ids(src, run.vocab, train_ids)
        val = src.val()
        if val is not None:  # every id of the validation file too, before any rank reads it
            val_ids = load_corpus(val, seq, split=False)
            check_token_ids(val, run.vocab, val_ids)
            overlap = overlap_problem(src, train_ids, val_ids)
            if overlap:
                raise ConfigError(overlap)
        tokenizer = src.tokenizer
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(str(exc)) from exc
    if tokenizer is None and cfg.log.sample_tokens > 0:
        raise ConfigError(f"log.sample_tokens = {cfg.log.sample_tokens}: data.source = {cfg.data.source!r} holds raw "
                          f"ids and names no tokenizer to turn samples into text; set data.tokenizer to its "
                          f"tokenizer.json (or .tiktoken) file, or log.sample_tokens = 0")
    return run


def ignored_flags(args, cfg) -> list[str]:
    """Shortcut flags given on the command line that the resolved layout would never read, each with
    why: accepted, they would be silent no-ops (a user comparing `--dp-mode naive` with `overlap`
    under ZeRO would be timing the same run twice). Only flags given explicitly are judged: a value a
    configuration file carries for other layouts is not the user's request for this one."""
    lay, m, out = cfg.layout, cfg.model, []

    def given(attr: str) -> bool:
        return getattr(args, attr, None) is not None

    replicas = lay.replicas
    if given("dp_mode"):
        if replicas == 1:
            out.append(f"--dp-mode {args.dp_mode}: there are no data-parallel replicas to synchronise "
                       "(layout.dp x ep x cp = 1)")
        elif lay.zero and lay.ep == 1:
            out.append(f"--dp-mode {args.dp_mode}: ZeRO-{lay.zero} synchronises gradients its own way "
                       f"(layout.zero = {lay.zero}), so the plain data-parallel mode is not used; drop it, or drop --zero")
    if given("bucket_mb"):
        if replicas == 1:
            out.append(f"--bucket-mb {args.bucket_mb}: there are no data-parallel replicas whose gradients "
                       "would be bucketed (layout.dp x ep x cp = 1)")
        elif lay.zero == 3 and lay.ep == 1:
            out.append(f"--bucket-mb {args.bucket_mb}: ZeRO-3 reduces each unit's flat vector as one "
                       "bucket, so a bucket size is not used (layout.zero = 3)")
        elif not lay.zero and lay.ep == 1 and lay.dp_mode == "naive":
            out.append(f"--bucket-mb {args.bucket_mb}: layout.dp_mode 'naive' all-reduces each gradient "
                       "on its own, without buckets; use --dp-mode bucketed or overlap")
    if given("schedule") and lay.pp == 1:
        out.append(f"--schedule {args.schedule}: a pipeline schedule needs pipeline stages (layout.pp = 1); "
                   "add --pp N")
    if given("top_k") and m.experts == 0:
        out.append(f"--top-k {args.top_k}: the MLPs are dense (model.experts = 0); add --experts N")
    return out


# The model.* fields that decide the parameters' shapes: a checkpoint of another value cannot load.
_SHAPE_FIELDS = ("name", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size", "rotary",
                 "tie_embeddings", "bias", "experts", "norm", "mlp")
# Fields a resumed run may change on purpose, without a note: its length, its logging, its layout.
_QUIET = {"train.steps", "train.log_every", "train.eval_every", "train.eval_batches", "train.compile",
          "train.compile_backend", "train.micro_batches", "data.cache_dir"}


def _resumed_checkpoint(cfg):
    """The checkpoint checkpoint.resume will load (for 'latest': the newest under checkpoint.dir; the
    ranks may fall back past a damaged one, which the same run saved), or None."""
    ck = cfg.checkpoint
    if ck.resume == "latest":
        found = list_checkpoints(checkpoint_dir(ck, cfg.log.out_dir))
        return found[-1][1] if found else None
    return Path(ck.resume).expanduser() if ck.resume else None


def check_resume_before_launch(cfg) -> list[str]:
    """A resumed run against the checkpoint's saved configuration, before any rank starts: another
    model shape is refused naming every field (the ranks raised one tensor's shape each, in a
    traceback); data of another tokenizer is refused (same-sized tokenizers loaded without an error,
    the embedding rows meaning other tokens); other changed settings (seed, batch, data, optimizer)
    are returned as notes: the run then no longer continues the saved one as it was. ConfigError."""
    path = _resumed_checkpoint(cfg)
    if path is None:
        return []
    try:
        saved = read_metadata(path).config or {}
    except CheckpointError:
        return []  # the ranks' integrity checks name it
    if not saved.get("model") or not saved.get("data"):
        return []
    now = cfg.to_dict()
    sm, m = saved["model"], now["model"]
    shape_fields = _SHAPE_FIELDS + (() if m.get("rotary") else ("seq_len",))  # learned positions: one row each
    kv = {k: (d.get("n_kv_head") or d.get("n_head")) for k, d in (("saved", sm), ("now", m))}
    # 0 is "derived" for these two (the data's vocabulary, 4 x d_model): compared only when both are stated.
    derived = {"vocab_size", "d_ff"}
    differ = [f"model.{k} = {m[k]!r}, the checkpoint's {sm[k]!r}" for k in shape_fields
              if k in sm and not (k in derived and not (sm[k] and m[k]))
              and (kv["saved"] != kv["now"] if k == "n_kv_head" else sm[k] != m[k])]
    if differ:
        raise ConfigError(f"checkpoint.resume: {path} was saved by another model, which cannot load into this one:\n  - "
                          + "\n  - ".join(differ) + "\nresume with the checkpoint's model.* values, or start afresh "
                          "(--overwrite, or another log.out_dir)")
    was, is_ = tokenizer_identity(saved["data"]), tokenizer_identity(now["data"])
    if was and is_ and was != is_:
        raise ConfigError(f"checkpoint.resume: {path} was trained on ids of tokenizer {was} (data.source = "
                          f"{saved['data'].get('source')!r}), but data.source = {cfg.data.source!r} holds ids of "
                          f"tokenizer {is_}: its embedding rows mean other tokens; give data made with the "
                          f"checkpoint's tokenizer")
    notes = []
    unchanged = _same_trajectory(saved, now)
    if unchanged:
        notes.append(unchanged)
    for section in ("model", "data", "optim", "train"):
        for k, v in saved.get(section, {}).items():
            key = f"{section}.{k}"
            if key in _QUIET or k not in now[section] or now[section][k] == v or section == "model" and k in shape_fields:
                continue
            if unchanged and key == "train.micro_batches":  # the micro-batch size is what counts (above)
                continue
            if isinstance(v, list) and tuple(v) == tuple(now[section][k]):
                continue
            notes.append(f"{key} {v!r} -> {now[section][k]!r}")
    head = notes[:1] if unchanged else []
    others = notes[len(head):]
    if others:
        return head + [f"resuming {path}, saved with other settings (the run continues it, but not as it was): "
                       + ", ".join(others)]
    return head


def _same_trajectory(saved: dict, now: dict) -> str | None:
    """train.deterministic on both sides, same global batch and micro-batch size: another layout
    continues the saved run bit for bit (docs/deterministic.md). The note saying so, else None."""
    def size(c: dict) -> tuple[int, int] | None:
        t, lay = c.get("train", {}), c.get("layout", {})
        rows = lay.get("dp", 1) * lay.get("ep", 1) * t.get("micro_batches", 1)
        return (t.get("global_batch"), t["global_batch"] // rows) if t.get("global_batch") and rows else None

    if not (saved.get("train", {}).get("deterministic") and now["train"].get("deterministic")):
        return None
    if size(saved) != size(now):
        return None
    lay_s, lay_n = saved.get("layout", {}), now["layout"]
    keys = ("dp", "zero", "pp", "schedule", "virtual_stages")
    if all(lay_s.get(k) == lay_n.get(k) for k in keys):
        return None
    was = ", ".join(f"{k} {lay_s.get(k)}" for k in keys if lay_s.get(k) != lay_n.get(k))
    is_ = ", ".join(f"{k} {lay_n.get(k)}" for k in keys if lay_s.get(k) != lay_n.get(k))
    return (f"train.deterministic: resuming a checkpoint of layout {was} at {is_} with the same global batch and "
            f"micro-batch size ({size(now)[1]} rows): the trajectory is unchanged, bit for bit")
