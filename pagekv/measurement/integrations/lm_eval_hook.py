"""`lm_eval --model pagekv`: the `pagekv` model in lm-eval's own command line.

lm-eval (0.4.13) finds its models in a registry that its own `lm_eval.models` fills,
and has no plugin discovery: an installed package cannot add a model name. So the
wheel installs this file as the top-level module `pagekv_lm_eval` with a
`pagekv_lm_eval.pth` that calls `install()` at interpreter start (setup.py's
`BuildPy`).

`install()` imports nothing: it puts a finder first on `sys.meta_path` that waits for
lm-eval's registry module (`lm_eval.api.registry`) and, right after that module runs,
registers `pagekv` the way lm-eval registers its own models: a lazy "module:Class"
placeholder (`lm_eval/models/__init__.py`'s `MODEL_MAPPING`). pagekv, torch included,
loads only when a run asks for `--model pagekv`. Then the finder takes itself off.
A process that never imports lm-eval pays one string comparison per import.

Standard library only, and nothing from pagekv: it runs as its own module.
"""

from __future__ import annotations

import importlib.abc
import sys

#: lm-eval's registry module, and what `pagekv` names in it.
REGISTRY = "lm_eval.api.registry"
MODEL = "pagekv"
TARGET = "pagekv.measurement.integrations.lm_eval_model:PageKVLM"


class RegisterPagekv(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when lm-eval's registry module is looked for, it takes the
    spec the other finders give and has its loader register `pagekv` after running the
    module."""

    def find_spec(self, name, path, target=None):
        if name != REGISTRY:
            return None
        sys.meta_path.remove(self)  # once: the registry module loads once
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def run_then_register(module):
            run(module)
            if MODEL not in module.model_registry:
                module.model_registry.register(MODEL, target=TARGET)

        spec.loader.exec_module = run_then_register
        return spec


def install() -> None:
    """Register `pagekv` in lm-eval's registry when it is imported (at once if it
    already is)."""
    registry = sys.modules.get(REGISTRY)
    if registry is not None:
        if MODEL not in registry.model_registry:
            registry.model_registry.register(MODEL, target=TARGET)
    elif not any(isinstance(f, RegisterPagekv) for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterPagekv())
