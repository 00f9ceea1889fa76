"""The persistent XLA compilation cache, on by default.

A compiled program is stored on disk keyed by its HLO, the compile options and the device, so a
repeated run, a resumed run and every row of ``experiments.speedup`` (a process each) compile a
step once per machine and read it back afterwards. ``run.compilation_cache`` names the folder
(``--compilation-cache DIR``) or turns it off (``off``); by default it is
``$JAX_COMPILATION_CACHE_DIR``, else ``xla/`` under the corpus cache folder (``data.cache_dir``,
``$JAXACCEL_CACHE_DIR``, ``~/.cache/jaxaccel``).

``MIN_COMPILE_SECONDS`` is the smallest compile worth a disk entry: JAX's default (1 s) would
leave out every step that compiles in under a second; 0.1 s keeps the many tiny programs of a
run out of the cache and the steps in it (``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``, when
set, wins). A folder that cannot be written is one warning line and the run goes on uncached."""

import os

import jax

from jaxaccel.run.config import check_writable
from jaxaccel.core.errors import ConfigError

MIN_COMPILE_SECONDS = 0.1


def resolve(setting: str | None, cache_dir: str | None) -> str | None:
    """The cache folder that ``setting`` (a folder, ``off`` or None) means; None when off."""
    if setting == "off":
        return None
    if setting:
        return os.path.abspath(os.path.expanduser(setting))
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.path.abspath(os.environ["JAX_COMPILATION_CACHE_DIR"])
    root = cache_dir or os.environ.get("JAXACCEL_CACHE_DIR") or "~/.cache/jaxaccel"
    return os.path.join(os.path.abspath(os.path.expanduser(root)), "xla")


def enable(folder: str | None) -> str | None:
    """Point JAX's persistent cache at ``folder`` (None: leave it off). Returns a warning line
    when the folder cannot be written (the run then compiles without a cache), else None."""
    if folder is None:
        if jax.config.jax_enable_compilation_cache:
            _reset()
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        check_writable("run.compilation_cache", folder, may_create=True)
        os.makedirs(folder, exist_ok=True)
    except (ConfigError, OSError) as e:
        _reset()
        jax.config.update("jax_enable_compilation_cache", False)
        reason = getattr(e, "strerror", None) or str(e)
        return (f"warning: compilation cache {folder} is not writable ({reason}); "
                f"compiling without it (pass --compilation-cache DIR or off)")
    # JAX decides whether to use its cache at a process's first compile and keeps the answer:
    # ask it again when the folder changes or the cache was off (an earlier run's "off" or
    # unwritable folder would otherwise leave every later run of the process uncached).
    if (not jax.config.jax_enable_compilation_cache
            or jax.config.jax_compilation_cache_dir != folder):
        _reset()
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:     # the user's wins
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return None


def _reset():
    """Make JAX look at its cache settings again: it reads them once, at the process's first
    compile, and keeps the answer (jax 0.11.2: ``compilation_cache.reset_cache``, internal)."""
    try:
        from jax._src import compilation_cache
        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass
