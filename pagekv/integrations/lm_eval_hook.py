"""`lm_eval --model pagekv`: the `pagekv` model in lm-eval's own command line.

lm-eval (0.4.13) finds its models in a registry (`lm_eval.api.registry`) that its
package `lm_eval.models` fills with lazy "module:Class" entries, and it has no plugin
discovery: an installed package cannot add a model name. So the wheel installs this
file as the top-level module `pagekv_lm_eval` with a `pagekv_lm_eval.pth` that calls
`install()` at interpreter start (setup.py's `BuildPy`).

`install()` imports nothing and puts a finder first on `sys.meta_path`. The finder
finds nothing itself; when `lm_eval.models` is imported, it wraps the loader the other
finders give so that, right after lm-eval's own models are registered, `pagekv` is
registered the same way, as the lazy entry `TARGET`: pagekv, torch included, loads
only when a run asks for `--model pagekv`. Then the finder takes itself off.

Why `lm_eval.models` and not the registry module: lm-eval imports `lm_eval.models`
only while its registry is empty (`get_model`), so an entry added before that would
leave lm-eval's own models (`hf`, `dummy`, ...) unregistered.

A process that never imports lm-eval pays one string comparison per import. Standard
library only (`sys`), and nothing from pagekv: it runs as its own module.
"""

from __future__ import annotations

import sys

#: The lm-eval package whose import registers lm-eval's own models, and what `pagekv`
#: names in its registry.
MODELS = "lm_eval.models"
MODEL = "pagekv"
TARGET = "pagekv.integrations.lm_eval_model:PageKVLM"


def register() -> None:
    """`pagekv` in lm-eval's registry as a lazy entry, unless it is there already (the
    model's own module registers the class itself when imported)."""
    from lm_eval.api.registry import model_registry

    if MODEL not in model_registry:
        model_registry.register(MODEL, target=TARGET)


class ThenRegister:
    """A loader that runs `loader`'s module, then `register()` and takes the finder off;
    anything else (sources, resources, ...) is `loader`'s."""

    def __init__(self, loader, finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        try:
            register()
        except Exception as e:  # lm-eval's own models load whatever becomes of ours
            import warnings

            warnings.warn(f"pagekv's lm-eval model is not registered: {e!r}", stacklevel=2)

    def __getattr__(self, name):  # only for what is not set here
        if name in ("loader", "finder"):
            raise AttributeError(name)
        return getattr(self.loader, name)


class RegisterPagekv:
    """Finds nothing itself: `lm_eval.models`' spec, as the other finders give it, with
    its loader wrapped in `ThenRegister`. (It stays until that module has run, so a
    look-up that does not import, `importlib.util.find_spec`, does not use it up.)"""

    def find_spec(self, name, path, target=None):
        if name != MODELS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = ThenRegister(spec.loader, self)
                return spec
        return None


def install() -> None:
    """Register `pagekv` when lm-eval's models are (at once if they already are)."""
    if MODELS in sys.modules:
        register()
    elif not any(isinstance(f, RegisterPagekv) for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterPagekv())
