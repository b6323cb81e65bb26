"""The typed run configuration: dataclasses with documented fields, TOML files, `--set` overrides.

    cfg = load_config("configs/gpt-small.toml", ["optim.lr=3e-4", "layout.dp=2", "layout.tp=2"])
    cfg.validate(world_size=4)       # raises ConfigError naming every field that does not fit
    print(cfg.to_toml())             # the resolved configuration, loadable again

One file holds everything a run needs (model, data, optimizer, schedule, layout, logging), so a
run is reproduced from its saved `config.toml` alone. Validation happens before any process
starts: an impossible layout costs a message, not a launch. Fields documented here are the
reference (the trainer's own sections in train/sections.py; [layout] and [sharding] beside the
strategies they configure); `shardlab train --help-config` prints them.

TOML has no null, so "use the default" is spelled 0 or "" where a field needs it (documented per
field).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlab.parallel.layout_section import LayoutSection
from shardlab.parallel.sharding.section import ShardingSection
from shardlab.train.config_check import problems as find_problems
from shardlab.train.sections import (
    CheckpointSection, DataSection, LogSection, ModelSection, OptimSection, TrainSection,
)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names each field and the values at fault."""


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "optim": OptimSection,
    "train": TrainSection,
    "layout": LayoutSection,
    "log": LogSection,
    "checkpoint": CheckpointSection,
    "sharding": ShardingSection,
}


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    layout: LayoutSection = field(default_factory=LayoutSection)
    log: LogSection = field(default_factory=LogSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    sharding: ShardingSection = field(default_factory=ShardingSection)

    # ------------------------------------------------------------------------------ building
    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "config") -> "Config":
        cfg = cls()
        for section, values in data.items():
            if section not in SECTIONS:
                raise ConfigError(f"{origin}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{origin}: [{section}] must be a table, got {values!r}")
            for key, value in values.items():
                cfg.set(f"{section}.{key}", value, origin)
        return cfg

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def set(self, dotted: str, value: Any, origin: str = "--set") -> None:
        """Set `section.key` to `value`, converted to the field's type or refused with its name."""
        section, _, key = dotted.partition(".")
        if section not in SECTIONS or not key:
            raise ConfigError(f"{origin}: {dotted!r} is not section.key; sections: {', '.join(SECTIONS)}")
        target = getattr(self, section)
        fields = {f.name: f for f in dataclasses.fields(target)}
        if key not in fields:
            raise ConfigError(f"{origin}: [{section}] has no field {key!r}; fields: {', '.join(fields)}")
        setattr(target, key, _coerce(f"{section}.{key}", value, fields[key].type, origin))

    def override(self, assignments: list[str]) -> None:
        """Apply `section.key=value` strings; values are TOML literals, bare words are strings."""
        for text in assignments:
            dotted, sep, raw = text.partition("=")
            if not sep:
                raise ConfigError(f"--set {text!r}: expected section.key=value")
            self.set(dotted.strip(), _parse_value(raw.strip()), f"--set {text}")

    def to_toml(self) -> str:
        lines = []
        for name in SECTIONS:
            lines.append(f"[{name}]")
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                lines.append(f"{key} = {toml_value(value)}")
            lines.append("")
        return "\n".join(lines)

    # ---------------------------------------------------------------------------- validation
    @property
    def world_size(self) -> int:
        """Ranks this layout needs: the product of its degrees (LayoutSection.world)."""
        return self.layout.world

    def problems(self) -> list[str]:
        """Every reason this configuration cannot run, each naming its fields and values (empty: it can):
        train/config_check.py's rules, each given the sections it reads."""
        return find_problems(**{name: getattr(self, name) for name in SECTIONS})

    def validate(self, world_size: int | None = None) -> None:
        """Raise ConfigError listing every problem, each naming the fields and values involved.

        world_size: the ranks actually available (under torchrun); None for a local launch, which
        starts exactly the ranks the layout needs.
        """
        problems = self.problems()
        if world_size is not None and world_size != self.world_size:
            degrees = " x ".join([f"layout.dp = {self.layout.dp}"]
                                 + [f"layout.{k} = {getattr(self.layout, k)}" for k in ("tp", "pp", "cp", "ep")
                                    if getattr(self.layout, k) != 1])
            problems.append(f"layout needs {self.world_size} ranks ({degrees}) but the job has world size {world_size}")
        if problems:
            raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))

    def frozen(self, parameter_name: str) -> bool:
        return self.model.frozen(parameter_name)


# ---------------------------------------------------------------------------------- values
def _parse_value(raw: str) -> Any:
    """A TOML literal ('3e-4', 'true', '"a b"', '[1, 2]'); anything else is taken as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _coerce(name: str, value: Any, annotation: Any, origin: str) -> Any:
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if kind == "bool":
        if isinstance(value, bool):
            return value
    elif kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind == "tuple[int, ...]":
        # A TOML list, or "3,2" (what --set layout.stage_layers=3,2 leaves as a bare word).
        items = [x for x in value.replace(" ", "").split(",") if x] if isinstance(value, str) else value
        items = [items] if isinstance(items, int) and not isinstance(items, bool) else items
        if isinstance(items, (list, tuple)):
            try:
                if all(not isinstance(x, (bool, float)) for x in items):
                    return tuple(int(x) for x in items)
            except ValueError:
                pass
    elif kind == "str":
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if name.startswith("sharding.") and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return ", ".join(f"{k}={v}" for k, v in value.items())  # [sharding]'s {heads = "tp"} tables
    raise ConfigError(f"{origin}: {name} must be {kind}, got {value!r}")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        # Control characters must be escaped or tomllib refuses the file we wrote.
        return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}" for c in value) + '"'
    return repr(value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: list[str] | None = None) -> Config:
    """Defaults, then `base` (a command's own defaults, e.g. verify's small model), then the TOML
    file (if any), then `section.key=value` overrides: each later source wins."""
    cfg = Config()
    cfg.override(base or [])
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8: other bytes are no config
            hint = (" (a configuration is TOML, not JSON: `shardlab train --dry-run` prints one)"
                    if path.suffix.lower() == ".json" else "")
            raise ConfigError(f"{path}: not valid TOML: {exc}{hint}") from exc
        if not data:  # an empty file (or comments only) would run the defaults without a word
            raise ConfigError(f"{path}: holds no settings (no [section] with a key); drop --config to run the "
                              f"defaults, or see configs/ for examples")
        for section, values in data.items():
            if section not in SECTIONS:
                known = ", ".join(SECTIONS)
                raise ConfigError(f"{path}: unknown section [{section}]; known: {known}" if isinstance(values, dict)
                                  else f"{path}: {section} = {values!r} is outside any section; every key belongs "
                                       f"under one of [{'], ['.join(SECTIONS)}]")
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: [{section}] must be one table, got {values!r}"
                                  + (" ([[...]] is an array of tables)" if isinstance(values, list) else ""))
            for key, value in values.items():
                cfg.set(f"{section}.{key}", value, str(path))
        if not cfg.log.out_dir:
            cfg.log.out_dir = str(Path("runs") / path.stem)
    cfg.override(overrides or [])
    if not cfg.log.out_dir:
        cfg.log.out_dir = "runs/default"
    return cfg
