"""Page-EntroKV: entropy-weighted, page-level KV-cache eviction under GQA.

The library is in layers, one folder each (docs/design.md, "Layers"):

- `pagekv.maths`: configuration, policies, profiles, entropy, pooling, pages, plan;
- `pagekv.runtime`: models, capture, runner, eviction backends, compaction, result;
- `pagekv.tasks`: prompts with a known answer;
- `pagekv.integrations`: Page-EntroKV as a kvpress press and as an lm-eval model;
- `pagekv.engine`: the comparison engine (the model worker, `Study` and its memos,
  `PromptSpec`, two `Side`s compared on one prompt), what `pagekv run` and the app use.

Beside them, `pagekv.app` holds what serves and draws the page (handlers, lessons,
figures, sessions): the library never imports it and the wheel does not hold it. The
research harness is the checkout's `experiments/` folder.

The public core::

    from pagekv import EvictionConfig, plan
    cfg = EvictionConfig(policy="entropy", budget=0.2, page_size=16)
    p = plan(profiles, n_groups=G, config=cfg)  # profiles [L, H, n]
    p.keep  # bool [L, G, n]

and real decoding (docs/research.md)::

    from pagekv import Runner, load_model
    lm = load_model("bundled")
    runner = Runner(lm.model, lm.tokenizer)
    pre = runner.prefill(input_ids)
    out = runner.evaluate(pre, cfg)  # out.answer, out.union_tokens, ...

The maths names import torch only. The runtime names (`Runner`, `load_model`, ...) load
on first use, so `import pagekv` does not import transformers; so do the engine's
`Study`, `PromptSpec`, `Prompt`, `Side` and `compare`::

    from pagekv import PromptSpec, Side, Study, compare
    study = Study.load("bundled")
    comp = compare(study, PromptSpec(context=2000), Side.of("mean", budget=0.1),
                   Side.of("entropy", budget=0.1))
    comp.records["A"].answer, comp.records["B"].correct

The Triton kernels are `pagekv.kernels`. Installed, they are the folder
`pagekv/kernels` (pyproject.toml maps the repository's top-level `kernels/` there); in
a checkout they stay the top-level `kernels/` folder, and `_CheckoutKernels` gives them
the same name, so the code imports them one way in both.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

from pagekv.maths.config import POLICIES, POOLED_POLICIES, EvictionConfig
from pagekv.maths.entropy import (
    HeadMasses,
    collision_entropy,
    collision_mass,
    entropy_head_weights,
    isolate_sinks,
    isolated_collision_mass,
    sink_heads,
    sink_mass,
)
from pagekv.maths.metrics import GroupOverlap, group_overlap, needle_retention, sink_advantage
from pagekv.maths.paging import BudgetError, min_feasible_budget, page_sizes, protected_pages
from pagekv.maths.plan import Plan, plan
from pagekv.maths.policies import Policy, get_policy
from pagekv.maths.profiles import attention_profiles, smooth_scores


class _CheckoutKernels(importlib.abc.MetaPathFinder):
    """Finds `pagekv.kernels` in a checkout: the repository's `kernels/` folder."""

    folder = Path(__file__).resolve().parent.parent / "kernels"

    def find_spec(self, name, path=None, target=None):
        if name != "pagekv.kernels":
            return None
        return importlib.util.spec_from_file_location(
            name, self.folder / "__init__.py", submodule_search_locations=[str(self.folder)]
        )


_installed = (Path(__file__).resolve().parent / "kernels").is_dir()
if not _installed and _CheckoutKernels.folder.is_dir():
    if not any(isinstance(f, _CheckoutKernels) for f in sys.meta_path):
        sys.meta_path.append(_CheckoutKernels())


#: Names loaded on first use: public name -> module that defines it.
_LAZY = {
    "BACKENDS": "pagekv.runtime.backend",
    "BackendError": "pagekv.runtime.backend",
    "resolve_backend": "pagekv.runtime.backend",
    "PagedCache": "pagekv.runtime.paged_cache",
    "LoadedModel": "pagekv.runtime.models",
    "ModelLoadError": "pagekv.runtime.model_errors",
    "load_model": "pagekv.runtime.models",
    "Prefill": "pagekv.runtime.prefill",
    "Runner": "pagekv.runtime.runner",
    "RunResult": "pagekv.runtime.result",
    # The comparison engine.
    "Prompt": "pagekv.engine.study",
    "PromptSpec": "pagekv.engine.study",
    "Study": "pagekv.engine.study",
    "Side": "pagekv.engine.comparison",
    "compare": "pagekv.engine.comparison",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagekv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BACKENDS",
    "BackendError",
    "BudgetError",
    "EvictionConfig",
    "GroupOverlap",
    "HeadMasses",
    "LoadedModel",
    "ModelLoadError",
    "POLICIES",
    "POOLED_POLICIES",
    "PagedCache",
    "Plan",
    "Policy",
    "Prefill",
    "Prompt",
    "PromptSpec",
    "RunResult",
    "Runner",
    "Side",
    "Study",
    "attention_profiles",
    "collision_entropy",
    "collision_mass",
    "compare",
    "entropy_head_weights",
    "get_policy",
    "group_overlap",
    "isolate_sinks",
    "isolated_collision_mass",
    "load_model",
    "min_feasible_budget",
    "needle_retention",
    "page_sizes",
    "plan",
    "protected_pages",
    "resolve_backend",
    "sink_advantage",
    "sink_heads",
    "sink_mass",
    "smooth_scores",
]

__version__ = "0.1.0"
