"""Published (and this project's measured) training runs, read from data files: one TOML file per
source in plan/data/runs/, every row with its citation. The one loader of the planner's reference runs.

    runs = load_runs()                      # every row of every source
    [r for r in runs if r.stack == "torchtitan" and r.generation == "hopper"]

A file has a `[source]` table (id, stack, hardware preset, cite, url, notes; `defaults` for every
row's layout; optional device overrides `memory_gib` and `memory_bw_tbps` when the source's GPUs differ
from the preset), optional `[tables.NAME]` (other figures of the source: source_file), `[models.NAME]` tables (shapes: GPTConfig fields plus the planner's
`attention`, `fused_loss`...), and `[[run]]` rows. A row names its model (a preset of plan/models.py
or a `[models]` entry; `model_set` overrides fields), gpus, global batch, layout (Execution fields)
and exactly one measured speed: `step_s`, `tokens_per_s` (whole job), `tokens_per_s_gpu` or
`tflops_gpu` with its `flops` convention ("model-full": 6N + 12 L d s per token, attention as the
whole square; "model-causal": half of it; "megatron-recompute": Narayanan et al. 2021's
96 B s l h^2 (1 + s/6h + V/16lh) per iteration, which counts full recomputation). `memory_gib`:
the peak the source reports; `reported`: other figures it prints (mfu, hfu, ...). `fit = false` with `why`:
shown, not fitted to.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path

from shardlab.plan.execution import Execution
from shardlab.plan.models import PRESETS, ModelSpec

DATA = Path(__file__).parent / "data"
RUNS_DIR = DATA / "runs"
GIB = 2 ** 30

# A GPU preset's generation: the stacks are fitted per generation (a 2023 stack on Hopper is not a
# 2020 one on Ampere). H100 and H200 share Hopper's SMs and kernels (the H200 has more, faster memory).
GENERATIONS = {"a100-80gb": "ampere", "a100-40gb": "ampere", "dgx-a100-hdr": "ampere", "h100-sxm": "hopper",
               "dgx-h100-ndr": "hopper", "h100-nvl256": "hopper", "h200": "hopper", "gb200-nvl72": "blackwell",
               "tpu-v4": "tpu-v4", "tpu-v5e": "tpu-v5e", "tpu-v5p": "tpu-v5p"}
SPEEDS = ("step_s", "tokens_per_s", "tokens_per_s_gpu", "tflops_gpu")
FLOPS = ("model-full", "model-causal", "megatron-recompute")
_ROW_KEYS = {"name", "cite", "model", "model_set", "gpus", "global_batch", "layout", "memory_gib", "fit", "why",
             "stack", "flops", "notes", "reported", *SPEEDS}
_LAYOUT_KEYS = {f.name for f in fields(Execution)}


@dataclass(frozen=True)
class Run:
    """One run: what ran (model, layout, GPUs), how fast (step_s), and where it is written."""

    name: str
    source: str             # the source file's id
    stack: str              # the software stack (megatron, torchtitan, composer, deepspeed, shardlab, ...)
    hardware: str           # a plan/hardware.py preset
    spec: ModelSpec
    layout: Execution
    gpus: int
    global_batch: int
    step_s: float
    cite: str               # source and table/row
    url: str
    memory_gib: float | None = None    # peak per GPU, as the source reports it
    fit: bool = True
    why: str = ""           # why a row is not fitted to
    memory_override_gib: float | None = None  # the source's device memory, where it differs from the preset
    memory_bw_override: float | None = None    # bytes/s
    reported: dict = field(default_factory=dict, compare=False)  # other figures the source prints (mfu, hfu, ...)

    @property
    def generation(self) -> str:
        return GENERATIONS.get(self.hardware, "unknown")

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.spec.seq_len / self.step_s

    def mfu(self, peak: float) -> float:
        """Model FLOPs utilisation in the planner's convention (causal attention counted as half)."""
        return self.tokens_per_s * self.spec.flops_per_token(causal=True) / (self.gpus * peak)


def _fail(path: Path, where: str, msg: str) -> ValueError:
    return ValueError(f"{path.name}: {where}: {msg}")


def _spec(path: Path, row: dict, models: dict, where: str) -> ModelSpec:
    name = row.get("model")
    if isinstance(name, str) and name in models:
        spec = ModelSpec(**{"name": name, **models[name]})
    elif isinstance(name, str) and name in PRESETS:
        spec = PRESETS[name]
    else:
        raise _fail(path, where, f"model {name!r} is neither a [models] entry of the file nor a preset "
                                 f"({', '.join(sorted(PRESETS))})")
    try:
        return replace(spec, **row.get("model_set", {}))
    except TypeError as exc:
        raise _fail(path, where, f"model_set {row.get('model_set')}: {exc}") from None


def _step_s(path: Path, row: dict, spec: ModelSpec, gpus: int, gb: int, where: str) -> float:
    given = [k for k in SPEEDS if k in row]
    if len(given) != 1:
        raise _fail(path, where, f"give exactly one of {', '.join(SPEEDS)}; got {given or 'none'}")
    key, value = given[0], float(row[given[0]])
    if value <= 0:
        raise _fail(path, where, f"{key} must be positive, got {value}")
    tokens = gb * spec.seq_len
    if key == "step_s":
        return value
    if key == "tokens_per_s":
        return tokens / value
    if key == "tokens_per_s_gpu":
        return tokens / (value * gpus)
    conv = row.get("flops")
    if conv not in FLOPS:
        raise _fail(path, where, f"tflops_gpu needs flops = one of {FLOPS}, got {conv!r}")
    if conv == "megatron-recompute":
        s, h, l, v = spec.seq_len, spec.d_model, spec.n_layer, spec.vocab_size
        per_step = 96 * gb * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    else:
        per_step = tokens * spec.flops_per_token(causal=conv == "model-causal")
    return per_step / (value * 1e12 * gpus)


def _load_file(path: Path) -> list[Run]:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path.name}: not valid TOML ({exc})") from None
    return runs_from_table(data, path)


def runs_from_table(data: dict, path: Path) -> list[Run]:
    """The runs of one source given as a table (a TOML file's, or a calibration file's `stack_runs`)."""
    src = data.get("source")
    for key in ("id", "stack", "hardware", "cite", "url"):
        if not isinstance(src, dict) or not src.get(key):
            raise _fail(path, "[source]", f"needs {key}")
    if src["hardware"] not in GENERATIONS:
        raise _fail(path, "[source]", f"hardware {src['hardware']!r} is not a GPU preset ({', '.join(GENERATIONS)})")
    defaults = src.get("defaults", {})
    mem_bw = src.get("memory_bw_tbps")
    out = []
    for i, row in enumerate(data.get("run", [])):
        where = f"run {i + 1} ({row.get('name', '?')})"
        unknown = set(row) - _ROW_KEYS
        if unknown:
            raise _fail(path, where, f"unknown field(s) {sorted(unknown)}; known: {sorted(_ROW_KEYS)}")
        lay = {**defaults, **row.get("layout", {})}
        bad = set(lay) - _LAYOUT_KEYS
        if bad:
            raise _fail(path, where, f"layout field(s) {sorted(bad)} are not Execution fields")
        for key in ("stage_layers", "recompute_keep"):
            if key in lay:
                lay[key] = tuple(lay[key])
        spec = _spec(path, row, data.get("models", {}), where)
        gpus, gb = int(row["gpus"]), int(row["global_batch"])
        execution = Execution(**lay)
        if execution.world != gpus:
            raise _fail(path, where, f"layout {execution.name()} spans {execution.world} GPUs, the row says {gpus}")
        out.append(Run(name=row["name"], source=src["id"], stack=row.get("stack", src["stack"]),
                       hardware=src["hardware"], spec=spec, layout=execution, gpus=gpus, global_batch=gb,
                       step_s=_step_s(path, row, spec, gpus, gb, where), cite=f"{src['cite']}, {row['cite']}",
                       url=src["url"], memory_gib=row.get("memory_gib"), fit=row.get("fit", True),
                       why=row.get("why", ""), memory_override_gib=src.get("memory_gib"),
                       memory_bw_override=mem_bw * 1e12 if mem_bw else None, reported=row.get("reported", {})))
    return out


@lru_cache(maxsize=1)
def stack_table() -> dict[str, dict]:
    """plan/data/stacks.toml: every stack's description (`what`) and the scales it fits (`fit`)."""
    return tomllib.loads((DATA / "stacks.toml").read_text())


@lru_cache(maxsize=4)
def load_runs(directory: Path = RUNS_DIR) -> tuple[Run, ...]:
    """Every run of every source file in `directory` (plan/data/runs/ by default), in file order."""
    files = sorted(directory.glob("*.toml"))
    if not files:
        raise ValueError(f"no run files (*.toml) in {directory}")
    return tuple(r for f in files for r in _load_file(f))


def source_runs(source_id: str) -> list[Run]:
    """The runs of one source file, by its [source] id."""
    runs = [r for r in load_runs() if r.source == source_id]
    if not runs:
        raise ValueError(f"no runs of source {source_id!r} in {RUNS_DIR}")
    return runs


@lru_cache(maxsize=16)
def source_file(source_id: str, directory: Path = RUNS_DIR) -> dict:
    """A source file's whole table (its [models] and [tables] beside the runs), by its [source] id."""
    for f in sorted(directory.glob("*.toml")):
        data = tomllib.loads(f.read_text())
        if data.get("source", {}).get("id") == source_id:
            return data
    raise ValueError(f"no source {source_id!r} in {directory}")


def sources(directory: Path = RUNS_DIR) -> list[dict]:
    """Each source file's [source] table (for docs and --validate-stacks), with its file name."""
    return [{**tomllib.loads(f.read_text())["source"], "file": f.name} for f in sorted(directory.glob("*.toml"))]
