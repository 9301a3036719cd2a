"""Models held by a shared server: one `Study` per model name, bounded and fair.

The app serves many sessions from one process. One session choosing another model
must not unload what the others use, and a name that cannot load must change nothing:

- the default model (``"bundled"``) is loaded on first use and never evicted;
- at most ``max_others`` other models stay loaded besides it; loading one more evicts
  the least recently used of them, and only once the new one has loaded;
- a model that cannot load evicts nothing: the request gets the default model's
  `Study` with ``loaded.fell_back = True`` and the reason in ``loaded.note`` (what
  ``load_model(..., allow_fallback=True)`` gives, without a second copy of the
  default model), and the failure is remembered for ``retry_after_s`` seconds;
- a public server loads only what it offers: a name that is neither the default nor
  one of ``known`` is refused in one sentence (`ModelRefused`) unless the registry
  allows hub models (``python app.py --allow-hub-models``); nothing is downloaded or
  opened for a refused name;
- thread-safe: the registry's lock guards its dictionaries only (never held across a
  call out); a model loads as a job on the model worker (`pagekv.engine.worker`), so
  requests for models already loaded never wait for it, and concurrent requests for
  one new model share one load;
- bounded: at most ``MAX_FAILURES`` failures are remembered (the oldest go first).

    registry = ModelRegistry(default="bundled", max_others=2)
    study = registry.get("bundled")            # loads once, then shared
    study = registry.get("Qwen/Qwen2.5-1.5B-Instruct")   # offline: the bundled Study,
    study.loaded.fell_back, study.loaded.note            # (True, "cannot load ...")
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from pagekv.engine.worker import WORKER
from pagekv.runtime.messages import one_line
from pagekv.runtime.models import (
    BUNDLED,
    BUNDLED_DESCRIPTION,
    KNOWN_MODELS,
    ModelLoadError,
    bundled_cache_dir,
    bundled_model,
)

log = logging.getLogger(__name__)

__all__ = ["MAX_FAILURES", "ModelRefused", "ModelRegistry", "model_key"]

#: Failed loads remembered at most (each for `retry_after_s`).
MAX_FAILURES = 32


class ModelRefused(ModelLoadError):
    """A model name this server does not offer (nothing was downloaded or opened)."""


def model_key(name: str | None) -> str:
    """The registry's key of a model name: a bundled model's key for every alias of it
    (``"bundled"`` for an empty name), else the name without surrounding spaces."""
    spec = bundled_model(name)
    return spec.key if spec is not None else (name or "").strip()


def _load_study(name: str, decode_dtype: str = "auto", hub_copy: bool = True):
    from pagekv.engine.study import Study
    from pagekv.runtime.models import load_model

    model = load_model(name, allow_fallback=False, hub_copy=hub_copy)
    return Study(model, decode_dtype=decode_dtype)


class ModelRegistry:
    """Loaded models by name (see the module docstring).

    Args:
        default: the model that stays loaded and that failed names fall back to.
        max_others: how many other models may stay loaded besides the default.
        factory: ``name -> Study`` (default: `load_model` without fallback, wrapped
            in a `Study` with its default memos); raises on failure.
        retry_after_s: a name that failed is not tried again for this long.
        known: the names offered besides the default (default: `KNOWN_MODELS`).
        allow_hub: also load any other hub name or local folder (off for a public
            server: `--allow-hub-models` or ``PAGEKV_ALLOW_HUB_MODELS=1`` turn it on).

    ``studies`` (an ordered dict, least recently used first) and ``lock`` are public
    so that tests can look at or reset the server's state.
    """

    def __init__(
        self,
        default: str = BUNDLED,
        max_others: int = 2,
        factory: Callable[[str], object] | None = None,
        retry_after_s: float = 60.0,
        known=None,
        allow_hub: bool = False,
    ):
        if max_others < 0:
            raise ValueError(f"max_others must be >= 0; got {max_others}")
        self.default = model_key(default)
        self.max_others = int(max_others)
        # A bundled model other than the default tries its hub copy only where hub
        # models are allowed: elsewhere a missing install is said at once.
        self.factory = factory or (
            lambda name: _load_study(
                name, self.decode_dtype, hub_copy=self.allow_hub or name == self.default
            )
        )
        #: How the default factory's studies decode (`Runner(decode_dtype=)`); set it
        #: before the first load (`python app.py --dtype`).
        self.decode_dtype = "auto"
        self.retry_after_s = float(retry_after_s)
        self.known = frozenset(model_key(k) for k in (KNOWN_MODELS if known is None else known))
        self.allow_hub = bool(allow_hub)
        self.studies: OrderedDict[str, object] = OrderedDict()
        self.lock = threading.Lock()
        self._failed: OrderedDict[str, tuple[float, BaseException]] = OrderedDict()

    def offered(self, name: str | None) -> bool:
        """Whether this registry may load `name` (the default, a known model, or any
        name when hub models are allowed)."""
        key = model_key(name)
        return self.allow_hub or key == self.default or key in self.known

    def unavailable(self, name: str | None) -> str | None:
        """Why `name` cannot load now, known without trying (one sentence), or None:
        it failed within `retry_after_s`, or it is a bundled model other than the
        default, neither installed nor converted, on a server without hub models."""
        key = model_key(name)
        failure = self._recent_failure(key)
        if failure is not None:
            return one_line(failure, bare=(ModelLoadError,))
        spec = bundled_model(key)
        if spec is None or key == self.default or self.allow_hub or self._cached(key):
            return None
        if bundled_cache_dir(spec.key).exists() or spec.installed():
            return None
        return spec.missing

    def serving(self, name: str | None) -> str:
        """The name of the model a request for `name` gets now: `name` itself, or the
        default where `name` cannot load (`unavailable`), so the page's model box can
        show the model that ran."""
        key = model_key(name)
        if not self.offered(key) or self.unavailable(key) is not None:
            return self.default
        return key

    def failures(self) -> int:
        """How many failed loads are remembered now (at most `MAX_FAILURES`)."""
        with self.lock:
            return len(self._failed)

    def set_default(self, name: str) -> None:
        """Make `name` the default (kept loaded); the old default becomes an ordinary
        entry, evicted like the others."""
        with self.lock:
            self.default = model_key(name)
            self._evict_locked()

    def loaded_names(self) -> list[str]:
        """Names of the loaded models, least recently used first."""
        with self.lock:
            return list(self.studies)

    def get(self, name: str | None):
        """The `Study` of `name`, loading it if needed (see the module docstring).

        Raises `ModelLoadError` (one line) only when the default model itself cannot
        load (then nothing can run).
        """
        key = model_key(name)
        if not self.offered(key):
            raise ModelRefused(
                f"this server does not offer the model {key!r}; choose one of "
                f"{', '.join(sorted(self.known | {self.default}))}"
            )
        study = self._cached(key)
        if study is not None:
            return study
        failure = self._recent_failure(key)
        if failure is None:
            try:  # one load per name at a time: a job on the model worker
                return WORKER.run(
                    ("load", id(self), key), lambda: self._load_job(key), owner=("load", key)
                )
            except Exception as e:
                failure = e
        if key == self.default:
            if isinstance(failure, ModelLoadError):
                raise failure
            raise ModelLoadError(one_line(failure, bare=(ModelLoadError,))) from failure
        return self._fallback(key, failure)

    # ------------------------------------------------------------------ internals

    def _cached(self, key: str):
        with self.lock:
            study = self.studies.get(key)
            if study is not None:
                self.studies.move_to_end(key)
            return study

    def _recent_failure(self, key: str) -> BaseException | None:
        with self.lock:
            entry = self._failed.get(key)
            if entry is None:
                return None
            when, error = entry
            if time.monotonic() - when > self.retry_after_s:
                del self._failed[key]
                return None
            return error

    def _load_job(self, key: str):
        """On the worker: the loaded `Study` of `key` (remembering a failure)."""
        study = self._cached(key)  # loaded by a job that ran while this one was queued
        if study is not None:
            return study
        error = self._recent_failure(key)
        if error is not None:
            raise error
        t0 = time.perf_counter()
        try:
            study = self.factory(key)
        except Exception as e:
            with self.lock:
                self._failed.pop(key, None)
                self._failed[key] = (time.monotonic(), e)
                while len(self._failed) > MAX_FAILURES:
                    self._failed.popitem(last=False)
            log.warning("model %r could not load: %s", key, one_line(e, bare=(ModelLoadError,)))
            raise
        with self.lock:
            self.studies[key] = study
            self._failed.pop(key, None)
            evicted = self._evict_locked()
        log.info(
            "model %r loaded in %.1f s; loaded now: %s%s",
            key,
            time.perf_counter() - t0,
            ", ".join(self.loaded_names()),
            f" (evicted {', '.join(evicted)})" if evicted else "",
        )
        if evicted:
            gc.collect()  # free the evicted weights now, not at some later collection
        return study

    def _evict_locked(self) -> list[str]:
        others = [k for k in self.studies if k != self.default]  # least recent first
        evicted = others[: max(0, len(others) - self.max_others)]
        for victim in evicted:
            del self.studies[victim]
        return evicted

    def _fallback(self, key: str, failure: BaseException):
        """The default's Study, marked as a fallback for `key` (shares its model and
        memos; nothing is loaded or evicted)."""
        base = self.get(self.default)
        what = f"the bundled {BUNDLED_DESCRIPTION}" if self.default == BUNDLED else self.default
        note = f"{one_line(failure, bare=(ModelLoadError,))} -> fell back to {what}"
        view = copy.copy(base)
        view.loaded = dataclasses.replace(base.loaded, fell_back=True, note=note)
        return view
