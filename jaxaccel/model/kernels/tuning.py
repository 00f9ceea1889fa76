"""Backend parameters of the flash attention kernel: per pass and head dim, block sizes and how a
backend runs them (Triton's warps and pipelining stages). First match wins:

1. ``block_q``/``block_k`` or a whole ``FlashParams`` passed to the kernel;
2. the device kind's rows (e.g. "NVIDIA H100 80GB HBM3") in ``tuned.json`` beside this file or
   ``$JAXACCEL_FLASH_TUNING``, by ``autotune.sweep`` (``python -m experiments.attention
   --tune``; checked against XLA; with date, jax version, command); a head dim above the largest
   row falls to 3.;
3. the built-in ``TRITON`` rows on a GPU (after Triton's fused-attention tutorial, unmeasured by
   us), ``INTERPRET`` in the Pallas interpreter.

A stage's backend is ``"triton"`` (sm80+) or, on Hopper, ``"mosaic_gpu"`` (``flash_mosaic``:
``num_stages`` ring slots, a consumer owns ``block_q`` query rows, ``block_k`` in dK/dV), used
by tuned rows where faster. Stages Mosaic GPU cannot run (float32, head dims above 128, GPUs
before Hopper) run on Triton with the same blocks.
"""

import dataclasses
import json
import os
from pathlib import Path

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxaccel.core.errors import ConfigError
from jaxaccel.core.sharding import target_device

TABLE_FILE = Path(__file__).with_name("tuned.json")
TABLE_ENV = "JAXACCEL_FLASH_TUNING"
TABLE_FORMAT = 1
BACKENDS = ("triton", "mosaic_gpu")
MOSAIC_ROWS = (64, 128)   # a Mosaic GPU consumer warpgroup's own rows
PASSES = ("forward", "dkv", "dq")
MIN_BLOCK = 16   # Triton's dot needs every dimension of a tile product >= 16


@dataclasses.dataclass(frozen=True)
class Stage:
    """How one pass tiles its work: query rows x key rows per tile, and Triton's launch knobs."""

    block_q: int
    block_k: int
    num_warps: int | None = None
    num_stages: int | None = None
    backend: str = "triton"


@dataclasses.dataclass(frozen=True)
class FlashParams:
    """One ``Stage`` per pass: forward, dK/dV (a program per key tile), dQ (per query tile)."""

    forward: Stage
    dkv: Stage
    dq: Stage

    def stages(self) -> tuple[Stage, ...]:
        return (self.forward, self.dkv, self.dq)

    def replace(self, **passes: Stage) -> "FlashParams":
        return dataclasses.replace(self, **passes)


# Largest head dim each row serves -> forward, dkv and dq stages (Triton backend, GPU).
TRITON = {
    64: FlashParams(Stage(128, 64, 4, 3), Stage(32, 128, 4, 3), Stage(128, 32, 4, 3)),
    128: FlashParams(Stage(128, 64, 8, 3), Stage(64, 128, 8, 2), Stage(128, 64, 8, 2)),
    256: FlashParams(Stage(64, 32, 8, 2), Stage(32, 64, 8, 1), Stage(64, 32, 8, 1)),
}

# Interpret mode (CPU): big tiles only cost time; 32 still gives several tiles at test lengths.
INTERPRET = FlashParams(forward=Stage(32, 32), dkv=Stage(32, 32), dq=Stage(32, 32))


def device_kind() -> str:
    """The device kind tuned tables are kept under (``sharding.target_device``'s)."""
    return target_device().device_kind


def table_path() -> Path:
    """The table file read and, by default, written: ``$JAXACCEL_FLASH_TUNING`` or tuned.json."""
    return Path(os.environ.get(TABLE_ENV) or TABLE_FILE)


def default_params(head_dim: int, *, interpret: bool) -> FlashParams:
    """The built-in row for this head dim (``INTERPRET`` in the interpreter)."""
    return INTERPRET if interpret else next(p for d, p in sorted(TRITON.items()) if head_dim <= d)


def flash_params(head_dim: int, seq_len: int, *, interpret: bool, block_q: int | None = None,
                 block_k: int | None = None, params: FlashParams | None = None,
                 kind: str | None = None) -> FlashParams:
    """The parameters a call uses (module docstring); ``block_q``/``block_k`` override every
    pass, ``kind`` the present device kind. Blocks are capped at the sequence rounded up to a
    power of two (at least ``MIN_BLOCK``), so a short sequence is not padded to a long tile."""
    if params is None:
        tuned = tuned_rows(kind or device_kind())
        params = next((p for d, p in sorted(tuned.items()) if head_dim <= d), None) \
            or default_params(head_dim, interpret=interpret)
    cap = max(MIN_BLOCK, pl.next_power_of_2(seq_len))

    def fit(name: str, stage: Stage) -> Stage:
        q_cap = k_cap = cap
        if stage.backend == "mosaic_gpu":     # a warpgroup's own rows stay 64 or 128
            q_cap, k_cap = (cap, max(cap, 64)) if name == "dkv" else (max(cap, 64), cap)
        stage = dataclasses.replace(stage, block_q=min(block_q or stage.block_q, q_cap),
                                    block_k=min(block_k or stage.block_k, k_cap))
        own = stage.block_k if name == "dkv" else stage.block_q
        if stage.backend == "mosaic_gpu" and own not in MOSAIC_ROWS:   # an override's blocks
            stage = dataclasses.replace(stage, backend="triton", num_warps=None)
        return stage

    return params.replace(**{name: fit(name, s) for name, s in zip(PASSES, params.stages())})


def compiler_params(stage: Stage, *, interpret: bool):
    """The Triton ``pallas_call`` compiler parameters for a stage, or none when interpreting."""
    if interpret:
        return None
    return pl_triton.CompilerParams(num_warps=stage.num_warps, num_stages=stage.num_stages)


def is_hopper(kind: str) -> bool:
    """An sm90 GPU by its device kind (the Mosaic GPU backend's wgmma and TMA need one)."""
    return any(name in kind for name in ("H100", "H200", "H800", "H20", "GH200"))


# ---- the tuned table ---------------------------------------------------------------------------

def tuned_rows(kind: str, path: Path | None = None) -> dict[int, FlashParams]:
    """The tuned rows for a device kind ({largest head dim: params}), {} when it has none."""
    path = path or table_path()
    entry = read_table(path)["devices"].get(kind, {})
    return {int(d): params_from_json(row, where=f"{path}: {kind}, head dim {d}")
            for d, row in entry.get("head_dims", {}).items()}


def read_table(path: Path) -> dict:
    """The table file's JSON ({"format": 1, "devices": {kind: entry}}), empty if no file;
    ConfigError when it is not a table."""
    if not path.exists():
        return {"format": TABLE_FORMAT, "devices": {}}
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"the flash tuning table {path} cannot be read ({e}); delete it or run "
                          f"python -m experiments.attention --tune to write it again") from None
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT \
            or not isinstance(table.get("devices"), dict):
        raise ConfigError(f"{path} is not a flash tuning table of format {TABLE_FORMAT}; delete "
                          f"it or run python -m experiments.attention --tune to write it again")
    return table


def params_to_json(params: FlashParams) -> dict:
    return {name: dataclasses.asdict(s) for name, s in zip(PASSES, params.stages())}


def params_from_json(row: dict, *, where: str = "flash params") -> FlashParams:
    """FlashParams from its JSON row; ConfigError, one line, for a row the kernel cannot run."""
    try:
        params = FlashParams(**{name: Stage(**row[name]) for name in PASSES})
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{where}: not a row of forward, dkv and dq stages ({e}); run "
                          f"python -m experiments.attention --tune again") from None
    check_params(params, where=where, fix="run python -m experiments.attention --tune again")
    return params


def check_params(params: FlashParams, *, where: str = "flash params",
                 fix: str = "pass powers of two such as 32, 64 or 128") -> None:
    """ConfigError unless each block is a power of two >= MIN_BLOCK and each backend can run."""
    for name, s in zip(PASSES, params.stages()):
        if s.backend not in BACKENDS:
            raise ConfigError(f"{where}: {name} backend {s.backend!r} is not one of "
                              f"{', '.join(BACKENDS)}; {fix}")
        own, field = (s.block_k, "block_k") if name == "dkv" else (s.block_q, "block_q")
        if s.backend == "mosaic_gpu" and own not in MOSAIC_ROWS:
            raise ConfigError(f"{where}: a mosaic_gpu {name} stage takes {field} 64 or 128 (a "
                              f"warpgroup's rows), not {own}; {fix}")
        for block in (s.block_q, s.block_k):
            if not isinstance(block, int) or block < MIN_BLOCK or block & (block - 1):
                raise ConfigError(f"{where}: {name} block {block!r} is not a power of two >= "
                                  f"{MIN_BLOCK}; {fix}")


def write_entry(path: Path, kind: str, head_dims: dict[int, FlashParams], meta: dict,
                passes: dict[int, list[str]] | None = None) -> None:
    """Records one device kind's tuned rows in the table file atomically, keeping the rest.
    ``meta`` (date, jax version, command) describes the entry's latest write and, under
    ``tuned_by``, each head dim written now, with its ``passes`` tuned (default all)."""
    table = read_table(path)
    entry = table["devices"].get(kind, {})
    rows = {**entry.get("head_dims", {}),
            **{str(d): params_to_json(p) for d, p in head_dims.items()}}
    provenance = {key: meta[key] for key in ("date", "jax_version", "command") if key in meta}
    tuned_by = {**entry.get("tuned_by", {}),
                **{str(d): {**provenance, "passes": list((passes or {}).get(d, PASSES))}
                   for d in head_dims}}

    def by_dim(d: dict) -> dict:
        return dict(sorted(d.items(), key=lambda item: int(item[0])))

    table["devices"][kind] = {**meta, "head_dims": by_dim(rows), "tuned_by": by_dim(tuned_by)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)
