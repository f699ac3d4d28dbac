"""PEP 517 backend for eecore: setuptools, built against the torch it will run with.

Why this exists: `pip install .` builds in an isolated environment. If `torch` were listed in
[build-system].requires, pip would install a second torch there (several GB, and possibly another
version than the one installed), and the extension would be compiled against headers that do not
match the library it loads at run time. Instead we find the torch of the interpreter that pip is
installing into, and put its site directory at the *end* of the build's sys.path, so the isolated
setuptools still wins but `import torch` in setup.py finds the real one.

`pip install --no-build-isolation .` bypasses all of this and works too.
"""
from __future__ import annotations

import os
import subprocess
import sys

from setuptools import build_meta as _setuptools

_PROBE = "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"


def _host_torch_site() -> str | None:
    """The site directory that holds the target interpreter's torch, or None."""
    try:
        import torch  # noqa: F401  (already importable: no isolation, nothing to do)

        return None
    except ImportError:
        pass
    # pip isolates the build with PYTHONPATH (an overlay that hides site-packages) and
    # PYTHONNOUSERSITE; without them the same interpreter sees its real environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    site = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None
    return site if site and os.path.isdir(site) else None


def _expose_host_torch() -> None:
    site = _host_torch_site()
    if site is not None and site not in sys.path:
        sys.path.append(site)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), site) if p)
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "eecore builds a torch extension and needs torch installed first, e.g. "
            "`pip install torch==2.13.0` (CPU) or a CUDA build of torch, then `pip install .`"
        ) from exc


# setuptools runs setup.py (which imports torch) in every hook, metadata ones included.
_expose_host_torch()


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _setuptools.build_sdist(sdist_directory, config_settings)
