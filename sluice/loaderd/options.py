"""Every `loaderd` option, declared once: its flag, type, default, bounds, help and the config field it fills.

`OPTIONS` is the one list. From it come:

* the command line (`add_options`: argparse, so `loaderd --help` and its
  refusals of a bad value);
* the fields of `ServerConfig` and `DataPathConfig` (`declared_fields`, a class
  decorator applied before ``@dataclass``), with their defaults;
* the values a command line gives those fields (`server_values`), and the data
  path's values (`data_path_values`);
* the option table of docs/loaderd.md (`markdown_table`; a test checks the page
  holds exactly it, and ``python -m sluice.loaderd.options docs/loaderd.md``
  writes it there).

A new option is one `Option` here plus the code that uses its field::

    Option("--lead-steps", "steps produced ahead of the consumer (default 32)", kind="int", default=32,
           field="lead_steps", type="int")

Defaults: `default` is the command line's (as a user types it: "256MiB").
A config field takes the converted command-line default unless the option
names `config_default` (a `Server` embedded in a trainer's process keeps
`memory_limit` "off"; the daemon's command line turns it on), and
`DataPathConfig` takes the config's unless it names `data_default`.
`REQUIRED` makes the field a required keyword. Options with no `field` are
read by `cli.py` itself (a file to read, replicas to work out, a signal to
ask for).

This module imports no other part of loaderd: the physical plane's
`DataPathConfig` is built from it, so it sits below that plane
(tests/test_layering.py).
"""

from __future__ import annotations

import argparse
import inspect
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sluice import doctable
from sluice.cliargs import ranged
from sluice.errors import SpecError

__all__ = ["BEGIN", "END", "OPTIONS", "Option", "REQUIRED", "add_options", "data_path_fields", "data_path_values",
           "declared_fields", "main", "markdown_table", "parse_size", "server_values", "with_table"]

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """'8GiB' -> 8589934592, '500M' -> 500000000, '4096' -> 4096; SpecError otherwise."""
    m = _SIZE.match(text)
    if not m:
        raise SpecError(f"size {text!r} is not a number of bytes such as 4096, 500MB or 8GiB")
    unit = (m.group(2) or "").lower().rstrip("b")
    if len(m.group(1)) > 30:  # also keeps int() below Python's 4300-digit limit
        raise SpecError(f"size {text[:40]!r}...: too many digits")
    return int(m.group(1)) * _UNITS[unit]


def _size_or_word(text: str) -> int | str:
    """--memory-limit: "auto", "off" or a size."""
    return text if text in ("auto", "off") else parse_size(text)


def _gil_cpu(text: str) -> int | str:
    """--gil-cpu: "auto", "off" or a CPU this process may run on (SpecError naming it otherwise)."""
    from sluice import affinity

    if text in ("auto", "off"):
        return text
    cpu = int(text) if text.isdigit() and len(text) < 6 else -1
    if cpu < 0 or (affinity.CPUS and cpu not in affinity.CPUS):
        raise SpecError(f"loaderd: --gil-cpu {text[:40]!r} is not 'auto', 'off' or a CPU this process may run on "
                        f"({sorted(affinity.CPUS) if affinity.CPUS else 'none: no affinity on this platform'})")
    return cpu


class _Marker:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


REQUIRED = _Marker("REQUIRED")  # a config field with no default: every caller names it
_FROM_CLI = _Marker("FROM_CLI")  # the converted command-line default
_FROM_CONFIG = _Marker("FROM_CONFIG")  # DataPathConfig: the same default as ServerConfig's

KINDS = ("text", "int", "float", "size", "choice", "switch", "append")


@dataclass(frozen=True)
class Option:
    """One `loaderd` option.

    `kind`: "text" (kept as given), "int"/"float" (within `bounds` when given:
    [lo, hi], or (lo, hi] with `low_open`), "size" (text such as 256MiB, made a
    byte count by `parse_size` when the config is built), "choice" (one of
    `choices`), "switch" (present or not), "append" (repeatable). `field`: the
    `ServerConfig` field it fills (annotation `type`), `data_field`: the
    `DataPathConfig` field too (the data path).
    `convert`: command-line value -> field value (sizes: `parse_size`).
    """

    flag: str
    help: str
    kind: str = "text"
    default: Any = None
    bounds: tuple[float, float] | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    required: bool = False
    field: str | None = None
    type: str = "Any"
    data_field: str | None = None
    convert: Callable[[Any], Any] | None = None
    config_default: Any = _FROM_CLI
    data_default: Any = _FROM_CONFIG

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"option {self.flag}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "size" and self.convert is None:
            object.__setattr__(self, "convert", parse_size)

    @property
    def dest(self) -> str:
        """The argparse attribute: --queue-bytes -> queue_bytes."""
        return self.flag.lstrip("-").replace("-", "_")

    def value(self, cli_value: Any) -> Any:
        """The field value of a command-line value."""
        return self.convert(cli_value) if self.convert is not None and cli_value is not None else cli_value

    def field_default(self, data_path: bool = False) -> Any:
        """The default of this option's ServerConfig field (its DataPathConfig field with `data_path`)."""
        if data_path and self.data_default is not _FROM_CONFIG:
            return self.data_default
        if self.config_default is not _FROM_CLI:
            return self.config_default
        return self.value(self.default)


# In `loaderd --help` order.
OPTIONS: tuple[Option, ...] = (
    Option("--cache", "node cache directory", required=True, field="cache_dir", type="str", data_field="cache_dir",
           config_default=REQUIRED),
    Option("--cache-budget", "node cache byte budget (default 8GiB)", kind="size", default="8GiB",
           field="cache_budget_bytes", type="int", data_field="cache_budget", config_default=REQUIRED),
    Option("--allow-root", "folder or URL prefix (s3://bucket/prefix/, gs://, az://, abfs://, hf://, "
           "https://host/path/) object locations may lie within (repeatable; default: the manifest's folder only: "
           "remote objects need an explicit URL root); a manifest outside is refused",
           kind="append", metavar="ROOT"),
    Option("--replicas", "data-parallel size R of the run (default 1)", kind="int", default=1,
           field="replicas", type="int"),
    Option("--serve", "replicas this node serves, e.g. 0,1 (default: all R)"),
    Option("--node-rank", "with --ranks-per-node K: serve replicas N*K .. N*K+K-1, the ranks torchrun puts on "
           "node N (instead of --serve; see docs/deploy.md)", kind="int", metavar="N"),
    Option("--ranks-per-node", "trainer ranks per node (--node-rank)", kind="int", metavar="K"),
    Option("--endpoint", "ipc://PATH or tcp://127.0.0.1:PORT|* (default: ipc socket in a private 0700 temp dir)",
           field="endpoint", type="str | None"),
    Option("--endpoint-file", "write the bound endpoint to this file (0600)"),
    Option("--curve-secret", "CurveZMQ secret key of the daemon (sluice curve-keys); with --curve-clients, "
           "encrypts and authenticates every connection and allows tcp beyond loopback", metavar="FILE"),
    Option("--curve-clients", "folder of the client public keys (*.key) allowed to connect", metavar="DIR"),
    Option("--token-file", "file (mode 0600) holding this run's token; every request must carry it "
           "(required for tcp:// and ipc://@ endpoints without CurveZMQ)", metavar="FILE"),
    Option("--state-dir", "fencing LMDB directory (default CACHE/loaderd-state)", field="state_dir",
           type="str | None"),
    Option("--metrics-port", "serve Prometheus /metrics on 127.0.0.1:PORT (0 = any free port; default off)",
           kind="int", bounds=(0, 65535), field="metrics_port", type="int | None"),
    Option("--metrics-ids", "label the metrics with the run and dataset IDs (default: the labels say 'hidden', "
           "since every local user can read the metrics port)", kind="switch", default=False,
           field="metrics_ids", type="bool"),
    Option("--workers", "read/decode/tokenize workers (default 2)", kind="int", default=2, bounds=(1, 1024),
           field="workers", type="int", data_field="workers"),
    Option("--worker-kind", "decode+tokenize text objects in threads or in worker processes (default thread; "
           "see docs/loaderd.md for the measurement)", kind="choice", choices=("thread", "process"),
           default="thread", field="worker_kind", type="str", data_field="worker_kind"),
    # "auto" is the physical plane's measured rule (demandpool.default_workers): cli.py converts it.
    Option("--demand-workers", "processes that tokenize the records a step needs out of order (0 = threads in the "
           "daemon; auto = the measured rule of docs/tokenize.md, 'Out of order')", default="auto",
           metavar="N|auto", field="demand_workers", type="int", data_field="demand_workers", config_default=0),
    Option("--tokenizer-threads", "threads the tokenizer encodes with in this daemon (its pool: tokenizers' "
           "RAYON_NUM_THREADS, fastokens' FASTOKENS_BPE_THREADS, tiktoken's and tokie's Python pool); worker "
           "processes share them out. Leave the trainer's cores free with N below the node's CPUs (auto = the CPUs "
           "this daemon may run on, its affinity; see docs/tokenize.md, 'Threads')", default="auto",
           metavar="N|auto", field="tokenizer_threads", type="int | None", data_field="tokenizer_threads",
           config_default=None),
    Option("--jit", "the fast producer path's compiled kernel (numba, the 'jit' extra): auto = once this "
           "machine's cache holds it compiled ahead of time (an extension module, built once by a child with "
           "numba's pycc and a C compiler), load it after the first call of every run; else load it through numba "
           "in the background once the run is long or the daemon waits (the run spec's max_steps leaves 2,048 "
           "steps, the producer waited 0.5 s for its consumer, or 2,048 steps made; that child builds the module "
           "for later runs), Plan.step until then or without numba; numba = the same without the module; off = "
           "Plan.step only (default auto; see docs/logical.md)",
           kind="choice",
           choices=("auto", "numba", "off"), default="auto", field="jit", type="str", data_field="jit"),
    Option("--arena", "where the producers write their calls' rows: on = a file under /dev/shm that the clients "
           "on this host (ipc://) map, so a BATCH is a reference to its arrays, not a copy; off = the heap, each "
           "BATCH's arrays copied into its client's ring (docs/loaderd.md, 'The arena'; default on)",
           kind="choice", choices=("on", "off"), default="on", field="arena", type="str"),
    Option("--lead-steps", "steps produced ahead of the consumer; the producer makes up to 16 a call (fewer where "
           "steps are large: a call's rows stay within 8 MiB), never past this lead (default 32)", kind="int",
           default=32, field="lead_steps", type="int"),
    Option("--queue-bytes", "assembled micro-batch bytes per replica (default 256MiB)", kind="size",
           default="256MiB", field="queue_bytes", type="int"),
    Option("--decoded-bytes", "decoded/tokenized object bytes (default 256MiB)", kind="size", default="256MiB",
           field="decoded_bytes", type="int", data_field="decoded_bytes"),
    Option("--request-ttl", "seconds a parked GET waits before it is answered ERROR EXPIRED (a live client asks "
           "again; a vanished one's credit is released); a silent client's HELLO peers claim "
           "and shared-memory ring lapse after twice this (default 60)", kind="float", default=60.0,
           bounds=(0, 86_400), low_open=True, field="request_ttl_s", type="float"),
    # A Server embedded in a trainer's process shares that process's memory: off unless asked for.
    Option("--memory-limit", "bound on the daemon's anonymous memory: above it every connection is dropped with "
           "what libzmq buffered for it, and clients restore as after a restart (auto: memory at start "
           "+ --queue-bytes per served replica + --decoded-bytes + 512MiB; see docs/hardening.md)",
           default="auto", metavar="SIZE|auto|off", field="memory_limit", type="int | str", convert=_size_or_word,
           config_default="off"),
    # A Server embedded in a trainer's process must not pin that process's threads: off unless asked for.
    Option("--gil-cpu", "keep the threads that share the GIL (the IO loop, the producers) on one CPU: auto (the "
           "one the IO loop starts on, left when other work keeps it busy), off (the scheduler places them), or a "
           "CPU number (docs/loaderd.md, 'One CPU for the GIL'; default auto)", default="auto",
           metavar="auto|off|CPU", field="gil_cpu", type="int | str", convert=_gil_cpu, config_default="off"),
    Option("--no-verify-on-read", "do not re-hash cache hits at lookup (the objects served are still verified "
           "when first mapped and after their file changes: docs/cache.md, 'Verified on the way out')",
           kind="switch", default=False, field="verify_on_read", type="bool", data_field="verify_on_read",
           convert=operator.not_),
    # A data path opened alone (a test, `sluice plan`) does not scrub: the daemon's does.
    Option("--scrub-rate", "bytes per second of mapped cache objects verified again in the background, changed or "
           "not, to find damage that leaves a file's timestamps alone (bit rot); 0 = off "
           "(default 32MiB: under 1%% of a core)", kind="size", default="32MiB", metavar="SIZE",
           field="scrub_rate", type="int", data_field="scrub_rate", data_default=0),
    Option("--log-level", "level of the JSON log lines on stderr (default info)", kind="choice", choices=("debug", "info", "warning", "error"), default="info"),
    Option("--parent-fd", "stop (as on SIGTERM) when this inherited pipe's read end reaches end-of-file: the "
           "process holding the write end exited (embedded mode; docs/loaderd.md, 'Stopping')", kind="int",
           metavar="FD"),
    Option("--parent-death-signal", "Linux: get SIGTERM when the thread that started this daemon exits (prctl "
           "PR_SET_PDEATHSIG; embedded mode, started from the trainer's main thread)", kind="switch",
           default=False),
)


def add_options(parser: argparse.ArgumentParser) -> None:
    """Every option of `OPTIONS` on `parser`, in order."""
    for o in OPTIONS:
        kw: dict[str, Any] = {"help": o.help}
        if o.kind == "switch":
            parser.add_argument(o.flag, action="store_true", **kw)
            continue
        if o.kind == "append":
            kw["action"] = "append"
        elif o.kind in ("int", "float"):
            kind = int if o.kind == "int" else float
            kw["type"] = kind if o.bounds is None else ranged(kind, *o.bounds, o.flag, low_open=o.low_open)
        elif o.kind == "choice":
            kw["choices"] = list(o.choices)
        if o.required:
            kw["required"] = True
        else:
            kw["default"] = o.default
        if o.metavar:
            kw["metavar"] = o.metavar
        parser.add_argument(o.flag, **kw)


def declared_fields(scope: str) -> Callable[[type], type]:
    """Class decorator (under ``@dataclass``): the fields of the options that fill `scope`, with their defaults.

    `scope` is "server" (`ServerConfig`: every option with a `field`) or "data_path" (`DataPathConfig`: those
    with a `data_field`). A `REQUIRED` field has no default (the dataclass must be ``kw_only``).
    """
    if scope not in ("server", "data_path"):
        raise ValueError(f"declared_fields: scope {scope!r} is not 'server' or 'data_path'")

    def add(cls: type) -> type:
        notes = dict(inspect.get_annotations(cls))
        for o in OPTIONS:
            name = o.field if scope == "server" else o.data_field
            if name is None:
                continue
            if name in notes:
                raise TypeError(f"{cls.__name__}.{name} is declared by option {o.flag} (options.py): not again")
            notes[name] = o.type
            default = o.field_default(data_path=scope == "data_path")
            if default is not REQUIRED:
                setattr(cls, name, default)
        cls.__annotations__ = notes
        return cls

    return add


def server_values(args: argparse.Namespace, **converted: Any) -> dict[str, Any]:
    """The `ServerConfig` fields the command line `args` gives (every option with a `field`), converted.

    `converted`: values by field name that the caller converted itself (a rule this module cannot import).
    """
    return {o.field: converted[o.field] if o.field in converted else o.value(getattr(args, o.dest))
            for o in OPTIONS if o.field is not None}


def data_path_values(config: Any) -> dict[str, Any]:
    """`DataPathConfig` keyword arguments from the fields of a `ServerConfig` (as JSON-able as they are)."""
    return {o.data_field: getattr(config, o.field) for o in OPTIONS if o.data_field is not None}


def data_path_fields() -> tuple[str, ...]:
    """The `DataPathConfig` fields declared here."""
    return tuple(o.data_field for o in OPTIONS if o.data_field is not None)


def _cell(text: str) -> str:
    """`text` in a markdown table cell: pipes and asterisks literal, argparse's %% as %."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("%%", "%")


def markdown_table() -> str:
    """The option table of docs/loaderd.md: every option, its value (as --help names it) with its bounds, its
    default, the config fields it fills and its help."""
    rows = ["| option | value | default | `ServerConfig` | `DataPathConfig` | what |",
            "| --- | --- | --- | --- | --- | --- |"]
    for o in OPTIONS:
        if o.kind == "switch":
            value, default = "", "off"
        else:
            value = o.metavar or ("|".join(o.choices) if o.kind == "choice" else o.dest.upper())  # as --help
            default = "required" if o.required else "" if o.default is None else str(o.default)
        if o.bounds is not None:
            lo, hi = o.bounds
            value += f" in {'(' if o.low_open else '['}{lo:g}, {hi:g}]"
        if o.kind == "append":
            value += " (repeatable)"
        fields = " | ".join(f"`{n}`" if n else "" for n in (o.field, o.data_field))
        rows.append(f"| `{o.flag}` | {_cell(value)} | {_cell(default)} | {fields} | {_cell(o.help)} |")
    return "\n".join(rows) + "\n"


BEGIN = "<!-- options: generated from sluice/loaderd/options.py by `python -m sluice.loaderd.options docs/loaderd.md` -->"
END = "<!-- end of options -->"


def with_table(page: str, where: str = "docs/loaderd.md") -> str:
    """`page` with the text between `BEGIN` and `END` replaced by `markdown_table()`."""
    return doctable.with_table(page, BEGIN, END, markdown_table(), where, "option table")


def main(argv: Iterable[str] | None = None) -> int:
    """Write the option table into each page named (docs/loaderd.md)."""
    return doctable.write_tables(argv, with_table, "options")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

