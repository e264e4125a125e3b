"""The project's C kernels (`bf16_linear.c`, `bf16_dot.c`, `paged_attention.c`, `decoder_ops.c`, `vocab_ops.c`, the
headers they include): compiled on first use with the machine's C
compiler (`cc`, about a second each) into $SPECSERVE_CACHE/kernels, keyed by the source's hash and flags, and
loaded with ctypes (whose calls release the GIL). Without a compiler a kernel is unavailable and its caller
takes torch's path."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
"""-ffp-contract=off: no FMA a source does not write (each kernel's sums are the ones it spells out)."""


def kernel(source: Path, switch: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The compiled `source` with each function's argument types set (`signatures`: name -> ctypes types), where
    this CPU runs it (AVX2 and FMA, which FLAGS compile for) and the environment variable `switch` is not 0."""
    from serve_app.hardware import cpu_flags

    if os.environ.get(switch, "1") == "0" or not {"avx2", "fma"} <= cpu_flags():
        return None
    lib = load(source)
    if lib is not None:
        for name, args in signatures.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
    return lib


def load(source: Path) -> ctypes.CDLL | None:
    """The compiled `source` (built now if this cache has no copy), or None where it cannot be built."""
    digest = hashlib.sha256(_text(source) + " ".join(FLAGS).encode()).hexdigest()[:16]
    name = f"{source.stem}-{digest}.so"
    from serve_app.models import cache_root  # models loads the kernels lazily, in turn

    for where in (cache_root() / "kernels", Path(tempfile.gettempdir()) / "specserve-kernels"):  # a read-only home: /tmp
        target = where / name
        try:
            if not target.exists() and not _build(source, target):
                return None
        except OSError as e:
            log.warning("%s: cannot write %s (%s)", source.name, where, e)
            continue
        return ctypes.CDLL(str(target))  # after torch: its libgomp.so.1 is the OpenMP runtime both use
    return None


def _text(source: Path) -> bytes:
    """The source's bytes and those of the headers it includes by quotes (its own folder's, one level: the
    kernels' headers include none), so an edited header builds a new library."""
    text = source.read_bytes()
    for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.M):
        text += (source.parent / name.decode()).read_bytes()
    return text


def _build(source: Path, target: Path) -> bool:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler for %s: torch's path instead", source.name)
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed: concurrent builders race safely
        out = Path(tmp) / target.name
        done = subprocess.run([cc, *FLAGS, str(source), "-o", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("%s did not compile (%s): torch's path instead\n%s", source.name, cc, done.stderr[-2000:])
            return False
        os.replace(out, target)
    return True
