"""setuptools' build (the project is in pyproject.toml), plus two files at the root of
the wheel so that lm-eval's own command line knows `--model pagekv`: the top-level
module `pagekv_lm_eval` (a copy of pagekv/integrations/lm_eval_hook.py) and
`pagekv_lm_eval.pth`, which Python's `site` runs at start to install its import hook.
lm-eval has no plugin discovery; the hook's docstring says how it registers the model.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = Path("pagekv", "integrations", "lm_eval_hook.py")
PTH_LINE = "import pagekv_lm_eval; pagekv_lm_eval.install()\n"


class BuildPy(build_py):
    """build_py, then the hook module and its `.pth` at the root of the build."""

    def run(self):
        super().run()
        root = self._root()
        self.copy_file(str(HOOK), str(root / "pagekv_lm_eval.py"))
        (root / "pagekv_lm_eval.pth").write_text(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        root = self._root()
        extra = [str(root / "pagekv_lm_eval.py"), str(root / "pagekv_lm_eval.pth")]
        return super().get_outputs(include_bytecode) + extra

    def _root(self) -> Path:
        """Where the wheel's root is built: build_lib, or for an editable install (whose
        wheel holds only what is written into it, not build_lib) install's `install_lib`,
        which setuptools' editable_wheel points at the wheel itself. There the hook is a
        copy: `pip install -e` again after changing it."""
        if getattr(self, "editable_mode", False):
            return Path(self.get_finalized_command("install").install_lib)
        return Path(self.build_lib)


setup(cmdclass={"build_py": BuildPy})
